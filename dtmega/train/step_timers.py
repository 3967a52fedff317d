"""Step timers (Megatron's --timing-log-level, --timing-log-option, --log-timers-to-tensorboard).

Level 0 measures the iteration time only, from the log window the trainer already times (no
synchronization added). Levels 1 and 2 time the phases of each step (data, forward-backward,
optimizer; level 2 splits the gradient norm and clipping from the optimizer), waiting for the
device at each phase boundary, which is what makes a phase time true on a GPU and also what
slows the step: use them to find where a step goes, not for throughput runs. At a log step the
phase means are gathered from every rank and reduced as --timing-log-option says."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch

from dtmega.mesh import gather_objects

PHASES = {1: ("data", "forward_backward", "optimizer"), 2: ("data", "forward_backward", "grad_norm", "optimizer")}


class StepTimers:
    """Per-phase wall time of each step, summed over a log window."""

    def __init__(self, level: int, option: str, device_type: str):
        self.level, self.option, self.device_type = level, option, device_type
        self.totals: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.device_type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize()

    @contextmanager
    def phase(self, name: str, level: int = 1) -> Iterator[None]:
        """Times the block as `name` when --timing-log-level is at least `level` (else runs it
        untimed, with no synchronization)."""
        if self.level < level:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - start

    def window(self, steps: int, elapsed: float) -> dict[str, float | list[float]]:
        """The window's record fields in ms per step (collective when the phases are timed, so
        every rank calls it at the same log step): iteration_ms, and each phase reduced over
        the ranks (`_max`, `_min` and `_max`, or `_ranks`: every rank's)."""
        record: dict[str, float | list[float]] = {"iteration_ms": 1e3 * elapsed / max(steps, 1)}
        if self.level == 0:
            return record
        mine = {name: 1e3 * self.totals.get(name, 0.0) / max(steps, 1) for name in PHASES[self.level]}
        self.totals.clear()
        everyone = gather_objects(mine)
        for name in PHASES[self.level]:
            values = [rank[name] for rank in everyone]
            if self.option == "all":
                record[f"{name}_ms_ranks"] = values
            else:
                record[f"{name}_ms_max"] = max(values)
                if self.option == "minmax":
                    record[f"{name}_ms_min"] = min(values)
        return record

    @staticmethod
    def is_timer(key: str) -> bool:
        """Whether a record field is a timer (kept out of TensorBoard and W&B unless
        --log-timers-to-tensorboard)."""
        return key == "iteration_ms" or any(key.startswith(f"{name}_ms") for name in PHASES[2])
