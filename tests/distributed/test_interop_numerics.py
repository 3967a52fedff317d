"""torchtitan's llama3 and Hugging Face's LlamaForCausalLM, parallelized without edits,
against their own unsharded copies: loss, every gradient, 5 AdamW steps (tolerances in
tests/helpers.py: 1e-5 relative, fp32)."""

from __future__ import annotations

import pytest

import dtmega
from dtmega.passes import DataParallel, Recompute, SequenceParallel, TensorParallel
from tests.helpers import assert_close_to_reference, clone_module, compare_training, first_copy_mesh
from tests.interop_models import hf_tiny_llama, torchtitan_debug_llama

PLANS = {
    "tp2": (dict(tp=2), [TensorParallel()]),
    "tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel()]),
    "fsdp2": (dict(dp_shard=2), [DataParallel("fsdp")]),
    "tp2_fsdp2": (dict(dp_shard=2, tp=2), [TensorParallel(), DataParallel("fsdp")]),
    "tp2_sp_recompute_ddp2": (
        dict(dp_replicate=2, tp=2), [TensorParallel(), SequenceParallel(), Recompute("full"), DataParallel("ddp")]
    ),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_torchtitan_llama3_matches_unsharded(name):
    sizes, passes = PLANS[name]
    reference = torchtitan_debug_llama(seed=5)
    pm = dtmega.parallelize(clone_module(reference), first_copy_mesh(**sizes), dtmega.Plan(passes))
    assert_close_to_reference(compare_training(reference, pm, steps=5, seq_len=16))


@pytest.mark.parametrize("name", list(PLANS))
def test_hf_llama_matches_unsharded(name):
    sizes, passes = PLANS[name]
    reference = hf_tiny_llama(seed=6)
    pm = dtmega.parallelize(clone_module(reference), first_copy_mesh(**sizes), dtmega.Plan(passes))
    assert_close_to_reference(compare_training(reference, pm, steps=5, seq_len=16))


def test_torchtitan_selective_recompute_matches_unsharded():
    reference = torchtitan_debug_llama(seed=8)
    pm = dtmega.parallelize(
        clone_module(reference), first_copy_mesh(dp_shard=2, tp=2),
        [TensorParallel(), Recompute("selective"), DataParallel("fsdp")],
    )
    assert_close_to_reference(compare_training(reference, pm, steps=5))


def test_hf_tied_embeddings_matches_unsharded():
    reference = hf_tiny_llama(seed=9, tie=True)
    pm = dtmega.parallelize(clone_module(reference), first_copy_mesh(dp_shard=2, tp=2), [TensorParallel(), DataParallel("fsdp")])
    assert_close_to_reference(compare_training(reference, pm, steps=5))
