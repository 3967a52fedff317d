"""Whole-step capture (issue 36): `dtmega.capture_step` compiles forward, backward, the
optimizer step and the after-step hooks as one program (aot_eager on this CPU: the graphs
inductor would get, run without code generation). Under TP2+SP, FSDP2, PP2 and CP2 training
with it equals the unsharded model over 5 AdamW steps (loss, every gradient, every parameter)
at the suite's 1e-5. One rank, and FP8 delayed scaling captured: tests/unit/test_step_capture.py.
Torch's own messages stay off the console (issue 47: Dynamo printed ~2,000 lines of tracebacks
under TP2 before the summary); they are in the log file the summary names. Compiling
`pm.forward_backward` whole under TP is refused with the fix (torch crashed inside)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

import dtmega
from dtmega.passes import ContextParallel, DataParallel, PipelineSplit, PlanError, SequenceParallel, TensorParallel
from dtmega.torch_messages import _console_handlers
from tests.helpers import assert_close_to_reference, build_dtmega_llama, compare_training, debug_llama, first_copy_mesh

PLANS = {
    "tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel()]),
    "fsdp2": (dict(dp_shard=2), [DataParallel("fsdp")]),
    "pp2": (dict(pp=2), [PipelineSplit(microbatches=2), DataParallel("ddp")]),
    "cp2": (dict(cp=2), [ContextParallel(method="all_gather"), DataParallel("fsdp")]),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_a_captured_step_trains_as_the_unsharded_model(name, capsys):
    sizes, passes = PLANS[name]
    # one block (PP2: one per stage): what the capture meets is the same in every block, and tracing is slow
    config = debug_llama(tie_embeddings=False, n_layers=2) if "pp" in sizes else debug_llama(n_layers=1)
    reference, meta_copy = build_dtmega_llama(config, seed=71)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(**sizes), dtmega.Plan(passes))
    pm.init_weights(seed=71)
    console = io.StringIO()  # what torch's console log handlers would print
    held = [(handler, handler.stream) for _, _, handler in _console_handlers()]
    for handler, _ in held:
        handler.setStream(console)
    try:
        assert_close_to_reference(compare_training(reference, pm, steps=5, seq_len=16,
                                                   batch_size=8 if "pp" in sizes else 4, capture="aot_eager"))
    finally:
        for handler, stream in held:
            handler.setStream(stream)
    assert console.getvalue() == "", console.getvalue()[:2000]
    printed = capsys.readouterr().out.splitlines()
    if dist.get_rank() == 0:
        assert printed[0].startswith("whole-step capture") and len(printed) <= 10, printed
        log = next((line.split(": ", 1)[1] for line in printed if "torch's messages" in line), None)
        if name == "tp2_sp":  # Dynamo gives up on frames with DTensor's backward: its tracebacks are in the file
            assert log is not None and "Traceback" in open(log).read(), printed


def test_compiling_forward_backward_whole_under_tp_is_refused_with_the_fix():
    _, meta_copy = build_dtmega_llama(debug_llama(n_layers=1), seed=71)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(tp=2), dtmega.Plan([TensorParallel(), SequenceParallel()]))
    pm.init_weights(seed=71)
    batch = pm.shard_batch(dtmega.synthetic_batch(4, 16, 256, seed=1))
    with pytest.raises(PlanError, match=r"Fix: .*Compile\(\).*capture_step"):
        torch.compile(pm.forward_backward, backend="aot_eager")(batch)

