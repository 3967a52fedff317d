"""`--check-for-spiky-loss` (issue 18, Megatron's rule): a loss above 10x the recent maximum
re-runs its step once on the same batch; reproduced = from the data or the model, not
reproduced = a transient fault, reported, and the step goes on with the re-run's result."""

from __future__ import annotations

import pytest

import dtmega
from dtmega.train.spiky_loss import MIN_HISTORY, SpikyLossCheck
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args

RUN = {"train_iters": 8, "eval_iters": 0, "log_interval": 1, "check_for_spiky_loss": True}
SPIKE_STEP = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("corpus"), documents=120)


@pytest.fixture(scope="module")
def clean(corpus):
    return train(tiny_args(corpus, **RUN)).losses


def _spike_on_calls(monkeypatch, calls: set[int]) -> None:
    """forward_backward's loss x 1000 on the given (1-based) calls: a fault in the loss only."""
    real, count = dtmega.ParallelModel.forward_backward, [0]

    def spiking(self, *args, **kwargs):
        count[0] += 1
        loss = real(self, *args, **kwargs)
        return loss * 1000 if count[0] in calls else loss

    monkeypatch.setattr(dtmega.ParallelModel, "forward_backward", spiking)


def test_a_transient_spike_is_reported_and_leaves_no_trace(corpus, clean, monkeypatch, capsys):
    """Only the first computation of step 6 spikes: the re-run gives the normal loss, the run
    says NOT reproduced, and every loss equals the clean run's (the re-run ran from the same
    random state on the same batch, and the weights never saw the spiky pass)."""
    _spike_on_calls(monkeypatch, {SPIKE_STEP})
    losses = train(tiny_args(corpus, **RUN)).losses
    out = " ".join(capsys.readouterr().out.split())
    assert f"spiky loss at step {SPIKE_STEP}:" in out and "NOT reproduced, a transient fault" in out
    assert losses == clean


def test_a_reproduced_spike_is_reported_as_data_or_model(corpus, monkeypatch, capsys):
    """Step 6 and its re-run (calls 6 and 7) both spike: reproduced; the step keeps that loss."""
    _spike_on_calls(monkeypatch, {SPIKE_STEP, SPIKE_STEP + 1})
    losses = train(tiny_args(corpus, **RUN)).losses
    out = " ".join(capsys.readouterr().out.split())
    assert f"spiky loss at step {SPIKE_STEP}:" in out and "reproduced, so it comes from the data or the model" in out
    assert losses[SPIKE_STEP - 1] > 100 * max(losses[:SPIKE_STEP - 1])


def test_without_the_flag_nothing_is_re_run(corpus, monkeypatch, capsys):
    _spike_on_calls(monkeypatch, {SPIKE_STEP})
    losses = train(tiny_args(corpus, **{**RUN, "check_for_spiky_loss": False})).losses
    assert "spiky loss" not in capsys.readouterr().out and len(losses) == RUN["train_iters"]


def test_the_rule():
    check = SpikyLossCheck()
    for loss in (5.0, 4.0, 3.0, 2.0):
        assert not check.is_spike(100.0)  # no baseline before MIN_HISTORY losses
        check.accept(loss)
    check.accept(float("nan"))  # not history
    assert len(check.recent) == MIN_HISTORY - 1
    check.accept(1.0)
    assert not check.is_spike(50.0) and check.is_spike(50.1) and not check.is_spike(float("inf"))
    spike = check.record(9, 60.0, 60.0001)
    assert spike.reproduced and not check.record(9, 60.0, 3.0).reproduced
