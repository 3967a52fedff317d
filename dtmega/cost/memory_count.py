"""Peak memory a training step really uses, for checking the cost model's memory prediction:
torch's MemTracker, which counts every tensor storage's bytes by device (resizes included, as
FSDP2 frees and refills its unsharded parameters), independent of any allocator."""

from __future__ import annotations

import gc
from typing import Callable

import torch


def peak_tracker():
    """A MemTracker without its per-module statistics, which refuse a module called more than
    once in a step (micro-batches, pipeline schedules, recompute)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs) -> None:
            pass

        def _post_fw_hook(self, module, inputs, outputs) -> None:
            pass

        def _pre_bw_hook(self, module, args) -> None:
            pass

        def _post_bw_hook(self, module, args) -> None:
            pass

    return PeakTracker()


def step_peak_bytes(step: Callable[[], None], module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    device: torch.device) -> float:
    """Peak bytes on `device` while `step()` runs once (call it after a warm-up step, so the
    optimizer's state exists), counting the module's and optimizer's tensors as well. Garbage
    of earlier work is collected first, so it is neither counted nor freed inside the step."""
    gc.collect()
    tracker = peak_tracker()
    tracker.track_external(module, optimizer)
    with tracker:
        step()
    return float(tracker.get_tracker_snapshot("peak")[device]["Total"])
