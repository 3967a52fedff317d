"""Context-parallel plans checked without any process group."""

from __future__ import annotations

import pytest
import torch

import dtmega
from dtmega.models import Llama, LlamaConfig
from dtmega.passes import ContextParallel, DataParallel, Plan, PlanError, Recompute, TensorParallel
from tests.helpers import mesh_shape


def llama(**overrides):
    with torch.device("meta"):
        return Llama(LlamaConfig.from_name("debug", **overrides))


def test_layout_marks_every_attention_core():
    lay = dtmega.check_plan(llama(), mesh_shape(cp=2), Plan([ContextParallel(method="a2a"), DataParallel("ddp")]))
    assert lay["layers.3.attention.core"].kernel == "attention.context_parallel.a2a"
    assert lay["layers.0.attention.wq"].params["weight"].placements == {}


def test_a2a_needs_heads_divisible_by_cp():
    with pytest.raises(PlanError, match=r"4 heads per rank are not divisible by cp=8"):
        dtmega.check_plan(llama(), mesh_shape(cp=8, tp=2),
                          Plan([TensorParallel(), ContextParallel(method="a2a"), DataParallel()]))
    dtmega.check_plan(llama(), mesh_shape(cp=8, tp=2), Plan([TensorParallel(), ContextParallel(method="ring"), DataParallel()]))


def test_gradients_need_a_data_parallel_pass():
    with pytest.raises(PlanError, match=r"add DataParallel\('ddp'\)"):
        dtmega.check_plan(llama(), mesh_shape(cp=2), Plan([ContextParallel()]))


def test_unknown_options_and_unsupported_combinations():
    with pytest.raises(PlanError, match="method='ulysses'"):
        dtmega.check_plan(llama(), mesh_shape(cp=2), Plan([ContextParallel(method="ulysses"), DataParallel()]))
    with pytest.raises(PlanError, match="load_balance='striped'"):
        dtmega.check_plan(llama(), mesh_shape(cp=2), Plan([ContextParallel(load_balance="striped"), DataParallel()]))
    with pytest.raises(PlanError, match="Recompute must run after ContextParallel"):
        dtmega.check_plan(llama(), mesh_shape(cp=2), Plan([Recompute("selective"), ContextParallel(), DataParallel()]))


def test_fsdp_and_hsdp_shard_over_cp_too():
    lay = dtmega.check_plan(llama(), mesh_shape(cp=2, dp_replicate=2, dp_shard=2),
                            Plan([ContextParallel(), DataParallel("hsdp")]))
    placements = lay["layers.0.attention.wq"].params["weight"].placements
    assert placements["cp"] == placements["dp_shard"] != placements["dp_replicate"]


def test_a_model_whose_attention_cannot_be_found():
    with pytest.raises(PlanError, match="cannot find the attention of Sequential"):
        dtmega.check_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)), mesh_shape(cp=2), Plan([ContextParallel(), DataParallel()]))


def test_a_mask_the_method_cannot_handle():
    from torchtitan.models.llama3 import llama3_configs

    with torch.device("meta"):
        flex = llama3_configs["debugmodel"](attn_backend="flex").build()
    with pytest.raises(PlanError, match="FlexAttention, whose block/document masks context parallelism cannot handle"):
        dtmega.check_plan(flex, mesh_shape(cp=2), Plan([ContextParallel(), DataParallel("ddp")]))
