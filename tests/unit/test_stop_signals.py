"""A stop is never lost (dtmega/stop_signals.py): Ctrl-C raised inside a finalizer is swallowed
by Python ("Exception ignored"); a suite run saw `dtmega train` keep training for 120 s after
SIGINT. The command's handlers record the signal and the training loop raises it again at the
next step."""

from __future__ import annotations

import gc
import os
import signal

import pytest

from dtmega.cli import main as dtmega_main
from dtmega.stop_signals import Stopped, StopSignals, raise_if_stopped
from tests.train_helpers import prepare_corpus, tiny_args


class _SignalsInItsFinalizer:
    """Garbage whose finalizer receives `signum` (as a signal arriving during a collection)."""

    def __init__(self, signum: int) -> None:
        self.signum, self.cycle = signum, self  # a cycle: freed by the collector, not by refcount

    def __del__(self) -> None:
        os.kill(os.getpid(), self.signum)
        sum(range(1000))  # bytecodes: Python runs the handler here, inside the finalizer


def _swallow(signum: int) -> None:
    _SignalsInItsFinalizer(signum)
    gc.collect()


@pytest.fixture
def foreground(monkeypatch):
    """Ctrl-C as a foreground process gets it (a suite started in the background by a
    non-interactive shell has SIGINT ignored, which the command keeps: see the last test)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("signum, exception", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Stopped)])
def test_a_stop_swallowed_in_a_finalizer_is_raised_again_and_said_once(signum, exception, capfd, foreground):
    before = signal.getsignal(signum)
    stops = StopSignals().install()
    try:
        _swallow(signum)  # the premise: this returns, the exception went nowhere
        assert stops.received == [signum]
        assert capfd.readouterr().err == ""  # no "Exception ignored ... Traceback": it is raised below
        with pytest.raises(exception):
            raise_if_stopped()
    finally:
        stops.restore()
    raise_if_stopped()  # nothing once the command is over
    assert signal.getsignal(signum) is before


def test_a_stop_during_the_import_is_held_until_it_is_done(foreground):
    stops = StopSignals(holding=True).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(1000))  # held: not raised here
        with pytest.raises(Stopped):
            stops.release()
    finally:
        stops.restore()


def test_training_stops_at_the_next_step_after_a_swallowed_ctrl_c(tmp_path, monkeypatch, capsys, foreground):
    from dtmega.train.trainer import Trainer

    corpus = prepare_corpus(tmp_path, documents=60)
    steps, step = [], Trainer.step

    def step_swallowing_ctrl_c(self, batch):
        steps.append(self.iteration + 1)
        if len(steps) == 2:
            _swallow(signal.SIGINT)
        return step(self, batch)

    monkeypatch.setattr(Trainer, "step", step_swallowing_ctrl_c)
    status = dtmega_main(["train", *tiny_args(corpus, train_iters=50, eval_iters=0, log_interval=1)])
    err = capsys.readouterr().err
    assert status == 130 and steps == [1, 2], (status, steps)
    assert "stopped by SIGINT (Ctrl-C)" in err and "Traceback" not in err and "Exception ignored" not in err, err


def test_a_signal_the_process_started_with_ignored_stays_ignored(foreground):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stops = StopSignals().install()
    try:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))
        raise_if_stopped()
        assert stops.received == []
    finally:
        stops.restore()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
