"""Mixture-of-experts plans checked without any process group: layouts and every error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dtmega
from dtmega.models import Llama, LlamaConfig
from dtmega.passes import (
    ContextParallel,
    DataParallel,
    ExpertParallel,
    Plan,
    PlanError,
    SequenceParallel,
    TensorParallel,
)
from tests.helpers import mesh_shape


def llama(name: str = "debug-moe", **moe):
    config = LlamaConfig.from_name(name)
    if moe:
        config = config.replace(moe=dataclasses.replace(config.moe, **moe))
    with torch.device("meta"):
        return Llama(config)


def test_layout_of_expert_and_data_parallelism():
    lay = dtmega.check_plan(llama(), mesh_shape(ep=2, dp_shard=2), Plan([ExpertParallel(), DataParallel("fsdp")]))
    experts = lay["layers.0.feed_forward.experts"]
    assert experts.kernel == "moe.dispatch.alltoall" and experts.wrap == "fsdp"
    # experts: split over ep, FSDP over the ranks holding the same experts; dense: FSDP over all four
    assert experts.params["w1"].placements == {"ep": "S(0)", "dp_shard": "S(0)"}
    assert lay["layers.0.feed_forward.router.gate"].params["weight"].placements == {"dp_shard": "S(0)", "ep": "S(0)"}
    assert experts.params["w1"].local_shape(lay.mesh) == (2, 64, 64)


def test_mixtral_8x7b_on_64_simulated_ranks():
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("mixtral-8x7b"))
    plan = Plan([TensorParallel(), SequenceParallel(), ExpertParallel(), DataParallel("fsdp", param_dtype="bfloat16")])
    lay = dtmega.check_plan(model, mesh_shape(tp=2, ep=8, dp_shard=4), plan)
    # One expert per ep rank, its hidden dim split over tp, FSDP over 4 ranks on the model dim.
    assert lay["layers.0.feed_forward.experts"].params["w1"].placements == {"tp": "S(1)", "ep": "S(0)", "dp_shard": "S(2)"}
    experts = 3 * 4096 * 14336 * 8 // (8 * 2 * 4)
    router = 4096  # 8 rows over 32 FSDP ranks: rank 0 holds one (torch.chunk semantics)
    dense = (2 * 4096 * 4096 + 2 * 4096 * 1024) // (2 * 32) + router + 2 * 4096 // 32
    assert lay.local_param_count() == 32 * (experts + dense) + 2 * 32000 * 4096 // 64 + 4096 // 32


@pytest.mark.parametrize("plan, sizes, message", [
    ([ExpertParallel(), DataParallel()], dict(ep=3, dp_shard=1), r"num_experts=8 is not divisible by ep=3"),
    ([ExpertParallel()], dict(ep=2), r"add DataParallel\('fsdp'\)"),
    ([ExpertParallel(dispatcher="deepep"), DataParallel()], dict(ep=2), "dispatcher='deepep'"),
    ([DataParallel()], dict(ep=2), r"mesh axis 'ep' has size 2 but no pass in the plan uses it.*ExpertParallel"),
    ([ExpertParallel(), TensorParallel(), DataParallel()], dict(ep=2, tp=2), "ExpertParallel must run after TensorParallel"),
])
def test_plan_errors(plan, sizes, message):
    with pytest.raises(PlanError, match=message):
        dtmega.check_plan(llama(), mesh_shape(**sizes), Plan(plan))


def test_a_model_whose_router_cannot_be_found():
    with pytest.raises(PlanError, match="cannot find the router and experts of Llama: its family .* names no mixture"):
        dtmega.check_plan(llama("debug"), mesh_shape(ep=2), Plan([ExpertParallel(), DataParallel()]))
    with pytest.raises(PlanError, match="cannot find the router and experts of Sequential: no registered model family"):
        dtmega.check_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)), mesh_shape(ep=2), Plan([ExpertParallel(), DataParallel()]))


def test_token_dropping_needs_whole_sequences():
    with pytest.raises(PlanError, match="drop tokens above capacity per sequence .* but ContextParallel splits them"):
        dtmega.check_plan(llama(capacity_factor=1.0), mesh_shape(cp=2), Plan([ContextParallel(), DataParallel()]))


def test_tensor_parallelism_of_other_libraries_moe_layers_is_refused():
    from tests.interop_models import hf_tiny_mixtral

    with pytest.raises(PlanError, match="does not shard the mixture-of-experts layers of hf-mixtral models yet"):
        dtmega.check_plan(hf_tiny_mixtral(), mesh_shape(tp=2), Plan([TensorParallel()]))


def test_expert_hidden_size_must_split_over_tp():
    with pytest.raises(PlanError, match=r"expert hidden size \(moe ffn_dim\)=30 is not divisible by tp=4"):
        dtmega.check_plan(llama(ffn_dim=30), mesh_shape(tp=4), Plan([TensorParallel()]))
