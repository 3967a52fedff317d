"""Divergence stops a run (issue 18): non-finite steps are skipped and said, a streak of
--max-skipped-steps stops the run with exit 2, and no checkpoint is written inside a streak.
Before, `--lr 1e6` trained on to exit 0 with NaN losses, saving checkpoints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dtmega.train.checkpoint import resolve_checkpoint
from dtmega.train.divergence import StepHealth, TrainingDiverged
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("corpus"), documents=120)


def _all_finite(checkpoint: Path) -> bool:
    """Every floating tensor of a saved checkpoint is finite (read back with DCP, no model)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint), str(flat))
    state = torch.load(flat, weights_only=True)
    tensors = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    walk(state)
    return bool(tensors) and all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def _infinite_norm(monkeypatch):
    """Every step's gradient norm infinite (a model that diverged before the run began)."""
    monkeypatch.setattr("dtmega.train.trainer.grad_norm", lambda params, group=None: torch.tensor(float("inf")))


def test_every_step_non_finite_stops_at_the_bound_without_a_checkpoint(corpus, tmp_path, capsys, monkeypatch):
    _infinite_norm(monkeypatch)
    save = tmp_path / "ckpt"
    with pytest.raises(TrainingDiverged, match=r"training diverged: the loss or gradient norm was not finite at steps "
                                               r"1-3 \(3 in a row, --max-skipped-steps 3\); no checkpoint was saved"):
        train(tiny_args(corpus, max_skipped_steps=3, train_iters=20, save=str(save), save_interval=1))
    out = capsys.readouterr().out
    assert "step 1: loss" in out and "not finite, step skipped" in out and "not saving at step 1" in out
    assert not list(save.glob("iter_*"))


def test_a_late_divergence_keeps_the_last_good_checkpoint_and_it_is_finite(corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    with pytest.raises(TrainingDiverged, match=r"not finite at steps (\d+)-\d+ \(4 in a row.*the last checkpoint, "
                                               r".*iter_\d+, was saved before the streak began"):
        train(tiny_args(corpus, lr=1e6, lr_warmup_iters=0, clip_grad=0, max_skipped_steps=4, train_iters=30,
                        save=str(save), save_interval=1))
    out = capsys.readouterr().out
    first_bad = int(re.search(r"step (\d+): loss", out).group(1))  # the first step the run reports unhealthy
    latest = resolve_checkpoint(save)
    assert int(latest.name.removeprefix("iter_")) < first_bad
    assert all(_all_finite(path) for path in save.glob("iter_*"))


def test_a_run_that_ends_inside_a_streak_fails_too(corpus, monkeypatch):
    _infinite_norm(monkeypatch)
    with pytest.raises(TrainingDiverged, match=r"training ended in 2 non-finite steps in a row \(steps 1-2\)"):
        train(tiny_args(corpus, max_skipped_steps=5, train_iters=2))


def test_the_check_can_be_turned_off(corpus, monkeypatch):
    """--no-check-for-nan-in-loss-and-grad: steps are still skipped, the run goes on (Megatron
    without the check)."""
    _infinite_norm(monkeypatch)
    result = train(tiny_args(corpus, train_iters=3, no_check_for_nan_in_loss_and_grad=True))
    assert result.iteration == 3


def test_a_diverged_run_is_an_input_error_of_the_cli():
    """The CLI prints a ValueError's message in one line and exits 2 (as for every input error,
    test_train_single_rank.py::test_train_cli_errors_exit_2_with_the_reason)."""
    assert issubclass(TrainingDiverged, ValueError)


def test_streak_bookkeeping():
    """One transient non-finite step resets; fp16 counts only a non-finite loss."""
    health = StepHealth(max_streak=2)
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)
    for step, (loss, norm) in enumerate([(one, nan), (one, one), (nan, one)], start=1):
        health.record(step, loss, norm)
    health.settle()
    assert health.skipped == 2 and health.streak == [3]
    fp16 = StepHealth(max_streak=2, loss_only=True)
    for step in range(1, 6):
        fp16.record(step, one, nan)  # gradient overflows: loss scaling's business
    fp16.settle()
    assert fp16.skipped == 0 and fp16.may_save()


def test_a_dead_model_stops_like_a_diverged_one_without_a_checkpoint(corpus, tmp_path, capsys):
    """`--init-method-std 1e30`: every logit saturates, the loss is ln(V) and the gradient norm 0
    at every step; before, ten checkpoints of the dead model were saved and the run exited 0."""
    save = tmp_path / "ckpt"
    with pytest.raises(TrainingDiverged, match=r"training is dead: steps 1-3 \(3 in a row\) had a loss of ln\(vocabulary\)"
                                               r" = [\d.]+ \(the loss of uniform predictions\), or a gradient norm of exactly 0"
                                               r".*no checkpoint was saved"
                                               r".*--init-method-std"):
        train(tiny_args(corpus, max_skipped_steps=3, train_iters=20, save=str(save), save_interval=1,
                        init_method_std=1e30))
    assert "the model is not learning" in capsys.readouterr().out
    assert not list(save.glob("iter_*"))


def test_dead_step_bookkeeping():
    """A zero gradient norm or a loss at ln(V) to 1e-5 is dead; an untrained model's loss a
    little above ln(V) is not; a live step ends the streak."""
    import math

    ln_v = math.log(384)
    health = StepHealth(max_streak=3, ln_vocab=ln_v)
    for step, (loss, norm) in enumerate([(ln_v * (1 + 3e-3), 1.0), (ln_v, 0.5), (2.0, 0.0), (2.0, 1.0)], start=1):
        health.record(step, torch.tensor(loss), torch.tensor(norm))
    assert health.may_save() and health.dead == []  # steps 2-3 were dead; the live step 4 ended the streak
    with pytest.raises(TrainingDiverged, match=r"steps 5-7 \(3 in a row\)"):
        for step in (5, 6, 7):
            health.record(step, torch.tensor(ln_v * (1 + 2e-6)), torch.tensor(0.7))
            health.settle()


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def _watch_updates(monkeypatch, bad_steps: set[int]) -> list[dict]:
    """Gives the steps in `bad_steps` (1-based) an infinite gradient norm and records, for every
    step, whether it changed any weight or any optimizer state tensor (compared bit for bit) and
    whether the weights after it are all finite."""
    from dtmega.train import trainer as trainer_module

    real_norm, real_update, calls, steps = trainer_module.grad_norm, trainer_module.Trainer._update, [0], []

    def norm(params, group=None):
        calls[0] += 1
        value = real_norm(params, group)
        return torch.full_like(value, float("inf")) if calls[0] in bad_steps else value

    def snapshot(trainer):
        weights = [_local(p.detach()).clone() for p in trainer.pm.parameters()]
        state = [_local(v).clone() for s in trainer.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
        return weights, state

    def update(self, loss, norm_value, params):
        (weights, state) = snapshot(self)
        out = real_update(self, loss, norm_value, params)
        (weights_after, state_after) = snapshot(self)
        steps.append({
            "weights_changed": any(not torch.equal(a, b) for a, b in zip(weights, weights_after, strict=True)),
            "state_changed": len(state) != len(state_after)
            or any(not torch.equal(a, b) for a, b in zip(state, state_after, strict=True)),
            "finite": all(bool(torch.isfinite(w).all()) for w in weights_after),
        })
        return out

    monkeypatch.setattr(trainer_module, "grad_norm", norm)
    monkeypatch.setattr(trainer_module.Trainer, "_update", update)
    return steps


@pytest.mark.parametrize("check", ["with_the_check", "without_the_check"])
def test_a_skipped_step_leaves_the_weights_and_the_optimizer_untouched(corpus, monkeypatch, capsys, check):
    """docs/reliability.md, Divergence: a non-finite step "is skipped (the optimizer does not
    step)", and under `--no-check-for-nan-in-loss-and-grad` "non-finite steps skipped, the run
    goes on". Step 2 of 3 gets an infinite gradient norm: it changes no weight and no optimizer
    state (bit for bit, no tolerance), the steps around it do, and every weight stays finite."""
    steps = _watch_updates(monkeypatch, bad_steps={2})
    off = check == "without_the_check"
    # no warmup: the first step's learning rate would be 0, and it would change no weight either
    result = train(tiny_args(corpus, train_iters=3, lr_warmup_iters=0, no_check_for_nan_in_loss_and_grad=off))
    assert result.iteration == 3 and len(steps) == 3
    assert [s["weights_changed"] for s in steps] == [True, False, True]
    assert [s["state_changed"] for s in steps] == [True, False, True]
    assert all(s["finite"] for s in steps)
    assert ("step 2: loss" in capsys.readouterr().out) is not off  # said on the console by the check only


def test_a_steps_health_is_read_one_step_late_except_before_a_save_and_at_the_end():
    """docs/reliability.md, Divergence: "step N is read after step N+1 is queued (no GPU
    bubble), except before a checkpoint and at the end". record(N) reads every step before N and
    leaves N unread; may_save() (asked before a checkpoint) and finish() read everything."""
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)
    health = StepHealth(max_streak=10)
    health.record(1, nan, one)
    assert health.skipped == 0 and health.streak == []  # step 1 queued, not read
    health.record(2, nan, one)
    assert health.skipped == 1 and health.streak == [1]  # step 1 read once step 2 is queued; step 2 not
    assert not health.may_save()  # before a checkpoint: step 2 read too
    assert health.skipped == 2 and health.streak == [1, 2]
    health.record(3, one, one)
    assert health.streak == [1, 2]  # the finite step 3 not read yet, so the streak stands
    health.record(4, nan, one)
    assert health.streak == [], "step 3 is read (and ends the streak) once step 4 is queued"
    with pytest.raises(TrainingDiverged, match=r"training ended in 1 non-finite steps in a row \(steps 4-4\)"):
        health.finish()  # at the end: the last step is read
    assert health.skipped == 3
