"""Ctrl-C and SIGTERM that a command never loses.

Python raises a signal's exception wherever the main thread happens to be. When that is inside
a finalizer (a `__del__` or a weakref callback, which the garbage collector runs at any
allocation), the exception cannot propagate: Python prints "Exception ignored in ..." with a
traceback and carries on, so a training run that was told to stop kept training (seen in a
suite run: SIGINT sent after the first checkpoint, the run still validating 30 steps later).

So the `dtmega` command's handlers also record the signal (`StopSignals.install`), a swallowed
stop prints nothing (it is not lost: it is raised again), and long loops call
`raise_if_stopped()` once per step: a stop swallowed anywhere is raised there, at the latest one
step later. The command turns either exception into its one line and exit status (cli.py).

While the command's module imports (seconds), a stop is held (`holding`) and raised by
`release()` once the import is done: torchrun stops every rank once one fails, and a rank killed
mid-import would die silently (exit -15) instead of saying which peer failed and why (seen in CI
under load).
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass, field


class Stopped(BaseException):
    """SIGTERM arrived (a scheduler's preemption, torchrun stopping its workers): unwinds like Ctrl-C."""


def _exception_for(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Stopped()


@dataclass
class StopSignals:
    """The signals a running command received, and the handlers that record them."""

    received: list[int] = field(default_factory=list)
    holding: bool = False  # record only, raise at `release()` (during the command's import)
    _previous: dict[int, object] = field(default_factory=dict)
    _previous_hook: object = None

    def install(self, signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> StopSignals:
        """Handlers that record the signal and raise its exception (KeyboardInterrupt for SIGINT,
        `Stopped` for SIGTERM); a no-op outside the main thread, where Python cannot set them. A
        signal this process was started with ignored stays ignored, as Python leaves it: a shell
        script's `dtmega train ... &` is meant not to stop on the terminal's Ctrl-C."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in signums:
            if signum not in self._previous and signal.getsignal(signum) is not signal.SIG_IGN:
                self._previous[signum] = signal.signal(signum, self._handle)
        if self._previous_hook is None:
            self._previous_hook = sys.unraisablehook
            sys.unraisablehook = self._unraisable
        _ACTIVE.append(self)
        return self

    def restore(self) -> None:
        """The handlers (and unraisable-exception hook) that were there before `install`."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        if self._previous_hook is not None:
            sys.unraisablehook = self._previous_hook
            self._previous_hook = None
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def release(self) -> None:
        """Ends `holding`: a stop received meanwhile is raised now."""
        self.holding = False
        raise_if_stopped()

    def _handle(self, signum: int, frame) -> None:
        self.received.append(signum)
        if not self.holding:
            raise _exception_for(signum)

    def _unraisable(self, unraisable) -> None:
        """A stop raised inside a finalizer is kept quiet: `raise_if_stopped` raises it again."""
        if isinstance(unraisable.exc_value, (KeyboardInterrupt, Stopped)) and self.received:
            return
        self._previous_hook(unraisable)


_ACTIVE: list[StopSignals] = []  # the command's handlers while it runs (signals are per process)


def raise_if_stopped() -> None:
    """Raises the exception of a stop signal the running command received but that never reached
    it (swallowed in a finalizer); nothing otherwise, or outside the `dtmega` command."""
    for stops in _ACTIVE:
        if stops.received:
            raise _exception_for(stops.received[0])
