"""Whole-step capture (issue 36): `dtmega.capture_step` compiles forward, backward, the
optimizer step and the after-step hooks as one program (aot_eager on this CPU: the graphs
inductor would get, run without code generation). Under TP2+SP, FSDP2, PP2 and CP2 training
with it equals the unsharded model over 5 AdamW steps (loss, every gradient, every parameter)
at the suite's 1e-5. One rank, and FP8 delayed scaling captured: tests/unit/test_step_capture.py."""

from __future__ import annotations

import pytest

import dtmega
from dtmega.passes import ContextParallel, DataParallel, PipelineSplit, SequenceParallel, TensorParallel
from tests.helpers import assert_close_to_reference, build_dtmega_llama, compare_training, debug_llama, first_copy_mesh

PLANS = {
    "tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel()]),
    "fsdp2": (dict(dp_shard=2), [DataParallel("fsdp")]),
    "pp2": (dict(pp=2), [PipelineSplit(microbatches=2), DataParallel("ddp")]),
    "cp2": (dict(cp=2), [ContextParallel(method="all_gather"), DataParallel("fsdp")]),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_a_captured_step_trains_as_the_unsharded_model(name):
    sizes, passes = PLANS[name]
    # one block (PP2: one per stage): what the capture meets is the same in every block, and tracing is slow
    config = debug_llama(tie_embeddings=False, n_layers=2) if "pp" in sizes else debug_llama(n_layers=1)
    reference, meta_copy = build_dtmega_llama(config, seed=71)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(**sizes), dtmega.Plan(passes))
    pm.init_weights(seed=71)
    assert_close_to_reference(compare_training(reference, pm, steps=5, seq_len=16,
                                               batch_size=8 if "pp" in sizes else 4, capture="aot_eager"))

