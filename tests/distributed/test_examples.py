"""The examples run and are right: the torch.compile-driven training script on TP2 x FSDP2
(aot_eager backend), the custom pass against the unsharded model."""

from __future__ import annotations

import pytest

import dtmega
from examples.custom_pass import MLPTensorParallel
from examples.train_llama import main as train_llama
from tests.helpers import assert_close_to_reference, build_dtmega_llama, compare_training, debug_llama, first_copy_mesh, mesh


def test_train_llama_compiled_loss_falls():
    losses = train_llama(["--steps", "25", "--tp", "2", "--compile", "aot_eager"])
    assert len(losses) == 25
    assert losses[-1] < losses[0] - 1.0, losses


def test_train_llama_with_context_parallelism_loss_falls():
    losses = train_llama(["--steps", "20", "--tp", "2", "--cp", "2", "--compile", "none", "--seq-len", "128"])
    assert losses[-1] < losses[0] - 1.0, losses


def test_train_llama_moe_with_expert_parallelism_loss_falls():
    losses = train_llama(["--steps", "20", "--model", "debug-moe", "--tp", "1", "--ep", "2", "--compile", "none"])
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["alone", "with_sp"])
def test_custom_pass_matches_unsharded(sequence_parallel):
    """The example pass applies what the layout says, so SequenceParallel after it (which turns
    w2's all-reduce into a reduce-scatter and splits the replicated attention's output onto the
    sequence shards) builds the model its layout describes."""
    reference, meta_copy = build_dtmega_llama(debug_llama(), seed=12)
    passes = [MLPTensorParallel(), *([dtmega.passes.SequenceParallel()] if sequence_parallel else [])]
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(tp=2), dtmega.Plan(passes))
    pm.init_weights(seed=12)
    assert pm.layout["layers.0.feed_forward.w1"].params["weight"].placements == {"tp": "S(0)"}
    assert pm.layout["layers.0.attention.wq"].style is None
    assert pm.layout["layers.0.feed_forward.w2"].outputs["tp"] == ("P->S(1)" if sequence_parallel else "P->R")
    assert_close_to_reference(compare_training(reference, pm, steps=5))


def test_compiled_model_matches_unsharded():
    reference, meta_copy = build_dtmega_llama(debug_llama(), seed=13)
    pm = dtmega.parallelize(
        meta_copy(), mesh(tp=2, dp_shard=2),
        [dtmega.passes.TensorParallel(), dtmega.passes.SequenceParallel(), dtmega.passes.DataParallel(),
         dtmega.passes.Compile("aot_eager")],
    )
    pm.init_weights(seed=13)
    assert pm.layout["layers.0"].compiled == "aot_eager"
    assert_close_to_reference(compare_training(reference, pm, steps=3, seq_len=48))


def test_compile_of_tp_without_sp_is_refused():
    _, meta_copy = build_dtmega_llama(debug_llama(), seed=13)
    with pytest.raises(dtmega.PlanError, match="needs SequenceParallel"):
        dtmega.parallelize(meta_copy(), first_copy_mesh(tp=2),
                           [dtmega.passes.TensorParallel(), dtmega.passes.Compile("aot_eager")])
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(tp=2), [dtmega.passes.TensorParallel()])
    with pytest.raises(dtmega.PlanError, match=r"compiling is a pass: add Compile\(backend='aot_eager'\) as the last "
                                               r"pass of the plan"):
        pm.compile(backend="aot_eager")
