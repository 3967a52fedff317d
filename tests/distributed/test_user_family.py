"""A family of one's own (tests/families/tiny_gpt, outside the package) under TP2+SP, FSDP2 and
TP2+SP x FSDP2 equals its unsharded model: loss, every gradient, 5 AdamW steps (fp32
tolerances of tests/helpers.py)."""

from __future__ import annotations

import pytest
import torch

import dtmega
from dtmega.passes import DataParallel, SequenceParallel, TensorParallel
from tests.families.tiny_gpt.model import TinyGPT, TinyGPTConfig
from tests.helpers import assert_close_to_reference, clone_module, compare_training, first_copy_mesh

PLANS = {
    "tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel()]),
    "fsdp2": (dict(dp_shard=2), [DataParallel("fsdp")]),
    "tp2_sp_fsdp2": (dict(tp=2, dp_shard=2), [TensorParallel(), SequenceParallel(), DataParallel("fsdp")]),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_a_family_of_ones_own_matches_its_unsharded_model(name):
    import tests.families.tiny_gpt  # noqa: F401  (registers the family)

    sizes, passes = PLANS[name]
    torch.manual_seed(29)
    reference = TinyGPT(TinyGPTConfig())
    pm = dtmega.parallelize(clone_module(reference), first_copy_mesh(**sizes), dtmega.Plan(passes))
    assert pm.layout["blocks.0.attn"].type == "Attention"
    assert_close_to_reference(compare_training(reference, pm, steps=5, seq_len=16))
