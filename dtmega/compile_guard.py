"""`torch.compile(pm.forward_backward)` refused with the way that works, before torch fails inside.

A ParallelModel's step cannot be compiled whole: its host side reads the batch (token ids
checked, loss tokens counted), and under tensor parallelism Dynamo fails in the vocab-parallel
loss ("got mixed torch.Tensor and DTensor", hundreds of lines of torch's traceback, no hint).
What works is compiling the blocks (`dtmega.passes.Compile()`, a plan pass) or the step through
`dtmega.capture_step` (which keeps the host side eager and compiles the rest).

Detected at the cause, the step's entry points, in two places: while Dynamo traces them
(`torch.compiler.is_compiling()`), the raise makes Dynamo give the frame up and run it eagerly;
run eagerly inside a `torch.compile`d call, torch's frame-evaluation callback is installed, and
the same check raises the `PlanError` itself (an exception of eager code reaches the caller as it
is). With `fullgraph=True` torch raises its own "Observed exception", whose context quotes it.
"""

from __future__ import annotations

import torch

from dtmega.passes.errors import PlanError


def _inside_compiled_call() -> bool:
    """True while a `torch.compile`d function runs (its frames are handed to Dynamo)."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:  # a torch without Dynamo: nothing compiles
        return False
    return get_eval_frame_callback() not in (None, False)


def refuse_whole_step_compile(entry: str) -> None:
    """Raises `PlanError` when the ParallelModel step `entry` (e.g. "forward_backward") is traced
    by or runs inside `torch.compile`; called first thing in each step entry point."""
    if torch.compiler.is_compiling() or _inside_compiled_call():
        raise PlanError(f"torch.compile(pm.{entry}) is not supported: the step's host side (token checks, loss token "
                        "count) cannot be traced, and under tensor parallelism torch fails in the vocab-parallel loss. "
                        "Fix: compile the blocks with dtmega.passes.Compile() as the plan's last pass, or the whole "
                        "training step with dtmega.capture_step(pm, optimizer)")
