"""When a run stops early on purpose, saving first: Megatron's --exit-interval,
--exit-duration-in-mins and --exit-signal-handler (a scheduler's SIGTERM finishes the step under
way, every rank agrees, the run saves and exits with status 0)."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class ExitConditions:
    """The run's exit flags and what has happened towards them; `start()` before the loop."""

    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False
    started: float = field(default_factory=time.monotonic)  # --exit-duration-in-mins counts from here
    sigterm: bool = False
    _previous: object = None

    def start(self) -> None:
        """With --exit-signal-handler, SIGTERM is noted instead of stopping at once (the `dtmega`
        command's handler, put back by `stop()`)."""
        if self.exit_signal_handler and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note_sigterm)

    def stop(self) -> None:
        """Puts back the SIGTERM handler `start()` replaced."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _note_sigterm(self, signum, frame) -> None:
        self.sigterm = True

    def reason(self, iteration: int) -> str | None:
        """Why the run stops after step `iteration`, or None. The duration and SIGTERM are agreed
        on by every rank (one all-reduce of two flags per step, only with those flags), so all of
        them save and stop at the same step."""
        if self.exit_interval and iteration % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval}"
        if self.exit_duration_in_mins is None and not self.exit_signal_handler:
            return None
        minutes = (time.monotonic() - self.started) / 60
        flags = torch.tensor([float(self.exit_duration_in_mins is not None and minutes > self.exit_duration_in_mins),
                              float(self.sigterm)])
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if flags[1] > 0:
            return "SIGTERM received (--exit-signal-handler)"
        return f"--exit-duration-in-mins {self.exit_duration_in_mins:g} reached" if flags[0] > 0 else None
