"""Pipeline plans checked without any process group: stage assignment, errors, and the
llama3-405b TP8 x PP8 x DP2 plan (128 simulated ranks) in seconds."""

from __future__ import annotations

import math
import time

import pytest
import torch

import dtmega
from dtmega.models import Llama, LlamaConfig
from dtmega.passes import DataParallel, Layout, PipelineSplit, Plan, PlanError, SequenceParallel, TensorParallel
from tests.helpers import mesh_shape


def llama(**overrides):
    with torch.device("meta"):
        return Llama(LlamaConfig.from_name("debug", **overrides))


def check(model, sizes, passes):
    return dtmega.check_plan(model, mesh_shape(**sizes), Plan(passes))


def test_even_and_virtual_assignment():
    lay = check(llama(n_layers=8), dict(pp=2), [PipelineSplit("pp", "interleaved_1f1b", 4, virtual_stages=2)])
    assert [lay[f"layers.{i}"].stage for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [lay[f"layers.{i}"].virtual_stage for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert lay["tok_embeddings"].stage == 0 and lay["output"].stage == 3 and lay["norm"].stage == 3
    assert lay["layers.5.attention.wq"].stage == 2  # submodules follow their block


def test_v_shape_for_zbv():
    lay = check(llama(n_layers=8), dict(pp=2), [PipelineSplit("pp", "zbv", 4, virtual_stages=2)])
    # rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    assert lay["layers.0"].virtual_stage == 0 and lay["layers.6"].stage == 3 and lay["layers.6"].virtual_stage == 1


def test_layers_not_divisible_without_uneven_split():
    with pytest.raises(PlanError, match=r"6 blocks do not split evenly into 4 stages.*first_stage_layers"):
        check(llama(n_layers=6), dict(pp=4), [PipelineSplit()])
    with pytest.raises(PlanError, match=r"8 blocks \(\+ embedding\) do not split evenly into 2 stages"):
        check(llama(n_layers=8), dict(pp=2), [PipelineSplit(count_embedding=True)])


def test_too_few_micro_batches():
    with pytest.raises(PlanError, match="'1f1b' needs at least as many micro-batches as stages: 2 < 4"):
        check(llama(), dict(pp=4), [PipelineSplit(microbatches=2)])
    with pytest.raises(PlanError, match="'dualpipev' needs at least as many micro-batches as stages: 3 < 4"):
        check(llama(), dict(pp=2), [PipelineSplit("pp", "dualpipev", 3, virtual_stages=2)])


def test_v_schedules_need_two_stages_per_rank():
    for schedule in ("zbv", "dualpipev"):
        with pytest.raises(PlanError, match="needs exactly two stages per rank"):
            check(llama(n_layers=8), dict(pp=2), [PipelineSplit("pp", schedule, 8, virtual_stages=1)])
    with pytest.raises(PlanError, match="runs one stage per rank"):
        check(llama(n_layers=8), dict(pp=2), [PipelineSplit("pp", "1f1b", 8, virtual_stages=2)])


def test_a_stage_left_with_no_layers():
    with pytest.raises(PlanError, match=r"stage\(s\) \[1, 2\] would hold no layers"):
        check(llama(n_layers=4), dict(pp=4), [PipelineSplit(first_stage_layers=2, last_stage_layers=2, microbatches=4)])
    with pytest.raises(PlanError, match="stage 1 holds no layers"):
        check(llama(n_layers=4), dict(pp=3), [PipelineSplit(layout="Et*2||t*2L", microbatches=4)])


def test_layout_strings_are_validated():
    lay = check(llama(n_layers=4), dict(pp=2), [PipelineSplit(layout="Et|t*3L", microbatches=2)])
    assert [lay[f"layers.{i}"].stage for i in range(4)] == [0, 1, 1, 1]
    with pytest.raises(PlanError, match="places 3 blocks; the model has 4"):
        check(llama(n_layers=4), dict(pp=2), [PipelineSplit(layout="Et|t*2L")])
    with pytest.raises(PlanError, match="E must appear once, in the first stage"):
        check(llama(n_layers=4), dict(pp=2), [PipelineSplit(layout="t*2|Et*2L")])


def test_unsupported_models_and_options():
    from tests.interop_models import hf_tiny_llama

    with pytest.raises(PlanError, match="must be an nn.ModuleDict"):
        check(hf_tiny_llama(), dict(pp=2), [PipelineSplit(microbatches=2)])
    with pytest.raises(PlanError, match="schedule='zero'"):
        check(llama(), dict(pp=2), [PipelineSplit(schedule="zero")])
    with pytest.raises(PlanError, match="mesh axis 'pp' has size 2 but no pass"):
        check(llama(), dict(pp=2), [])


def stage_params(lay, local: bool = False) -> dict[int, int]:
    """Parameters per pipeline stage: global, or on the rank at coordinate 0."""
    counts: dict[int, int] = {}
    for entry in lay.modules.values():
        for param in entry.params.values():
            shape_ = param.local_shape(lay.mesh) if local else param.shape
            counts[entry.stage] = counts.get(entry.stage, 0) + math.prod(shape_)
    return counts


def test_llama3_405b_tp8_pp8_dp2_in_seconds():
    start = time.perf_counter()
    config = LlamaConfig.from_name("llama3-405b")
    with torch.device("meta"):
        model = Llama(config)
    # 126 blocks + embedding + loss = 128 slots: 16 per stage, Llama 3 405B's own split.
    plan = Plan([TensorParallel(), SequenceParallel(), PipelineSplit(microbatches=16, count_embedding=True,
                                                                      count_loss=True), DataParallel("fsdp")])
    lay = dtmega.check_plan(model, mesh_shape(pp=8, dp_shard=2, tp=8), plan)
    assert time.perf_counter() - start < 30
    embedding = config.vocab_size * config.dim
    block = (config.num_params() - 2 * embedding - config.dim) // config.n_layers
    expected = {0: 15 * block + embedding, 7: 15 * block + config.dim + embedding}
    expected.update({s: 16 * block for s in range(1, 7)})
    counts = stage_params(lay)
    counts.pop(None, None)  # the root holds no parameters
    assert counts == expected
    local = stage_params(lay, local=True)
    # weights split over TP8 x FSDP2 = 16 ranks; the two norms per block only over FSDP2
    assert local[3] == 16 * ((block - 2 * config.dim) // 16 + 2 * config.dim // 2)
    # a rank counts only its own stage
    assert lay.local_param_count() == local[0] and lay.local_param_count({"pp": 3}) == local[3]
    assert Layout.from_toml(lay.to_toml()).local_param_count({"pp": 7}) == local[7]
