"""Context parallelism in whole models against the unsharded model: CP2, CP4, CP2 x TP2,
CP2 x DP2, CP2 x PP2, CP2 x HSDP and CP2 with selective recompute for every method; torchtitan and Hugging Face
Llamas; loss, every
gradient, 5 AdamW steps (tolerances in tests/helpers.py: 1e-5 relative, fp32)."""

from __future__ import annotations

import pytest

import dtmega
from dtmega.passes import (
    Compile,
    ContextParallel,
    DataParallel,
    PipelineSplit,
    Recompute,
    SequenceParallel,
    TensorParallel,
)
from tests.helpers import (
    assert_close_to_reference,
    build_dtmega_llama,
    clone_module,
    compare_training,
    debug_llama,
    first_copy_mesh,
)
from tests.interop_models import hf_tiny_llama, torchtitan_debug_llama

METHODS = ["ring", "all_gather", "a2a"]
PLANS = {
    "cp2": (dict(cp=2), lambda m: [ContextParallel(method=m), DataParallel("ddp")]),
    "cp4": (dict(cp=4), lambda m: [ContextParallel(method=m), DataParallel("fsdp")]),
    "cp2_tp2_sp": (dict(cp=2, tp=2), lambda m: [TensorParallel(), SequenceParallel(), ContextParallel(method=m),
                                               DataParallel("fsdp")]),
    "cp2_dp2": (dict(cp=2, dp_shard=2), lambda m: [ContextParallel(method=m), DataParallel("fsdp")]),
    "cp2_pp2": (dict(cp=2, pp=2), lambda m: [ContextParallel(method=m), PipelineSplit(microbatches=2),
                                            DataParallel("ddp")]),
    "cp2_hsdp2": (dict(cp=2, dp_replicate=2), lambda m: [ContextParallel(method=m), DataParallel("hsdp")]),
    "cp2_selective_recompute": (dict(cp=2), lambda m: [ContextParallel(method=m), Recompute("selective"),
                                                        DataParallel("ddp")]),
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(PLANS))
def test_dtmega_llama_with_context_parallelism(name, method):
    sizes, passes = PLANS[name]
    check_plan(sizes, passes(method))


def check_plan(sizes: dict, passes: list) -> None:
    reference, meta_copy = build_dtmega_llama(debug_llama(), seed=21)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(**sizes), dtmega.Plan(passes))
    pm.init_weights(seed=21)
    assert_close_to_reference(compare_training(reference, pm, steps=5, seq_len=32))


def test_compiled_ring_attention_model_matches_unsharded():
    reference, meta_copy = build_dtmega_llama(debug_llama(), seed=25)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(cp=2), [ContextParallel(), DataParallel("fsdp"), Compile("aot_eager")])
    pm.init_weights(seed=25)
    assert_close_to_reference(compare_training(reference, pm, steps=3, seq_len=32))


@pytest.mark.parametrize("method", METHODS)
def test_torchtitan_llama3_with_context_parallelism(method):
    reference = torchtitan_debug_llama(seed=22)
    pm = dtmega.parallelize(clone_module(reference), first_copy_mesh(cp=2, tp=2),
                            [TensorParallel(), ContextParallel(method=method), DataParallel("ddp")])
    assert_close_to_reference(compare_training(reference, pm, steps=5, seq_len=32))


@pytest.mark.parametrize("method", METHODS)
def test_hf_llama_with_context_parallelism(method):
    reference = hf_tiny_llama(seed=23)
    pm = dtmega.parallelize(clone_module(reference), first_copy_mesh(cp=2), [ContextParallel(method=method), DataParallel("ddp")])
    assert_close_to_reference(compare_training(reference, pm, steps=5, seq_len=32))


def test_without_load_balancing_and_sequence_errors():
    reference, meta_copy = build_dtmega_llama(debug_llama(), seed=24)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(cp=4), [ContextParallel(load_balance=None), DataParallel("ddp")])
    pm.init_weights(seed=24)
    assert_close_to_reference(compare_training(reference, pm, steps=2, seq_len=12))
    with pytest.raises(ValueError, match="sequence length 10 is not divisible by cp = 4"):
        pm.forward_backward(dtmega.synthetic_batch(4, 10, 256))
    zigzag = dtmega.parallelize(meta_copy(), first_copy_mesh(cp=2), [ContextParallel(), DataParallel("ddp")])
    with pytest.raises(ValueError, match=r"sequence length 6 is not divisible by 2 x cp = 4 \(zigzag"):
        zigzag.forward_backward(dtmega.synthetic_batch(4, 6, 256))
