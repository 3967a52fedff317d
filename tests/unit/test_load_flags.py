"""Megatron's checkpoint-loading flags: --finetune, --no-load-optim, --no-load-rng, --no-save-optim.

Each against the plain resume of the same checkpoint: a resume reproduces the uninterrupted run's
losses; the flags change exactly what they name."""

from __future__ import annotations

import pytest
import torch

from dtmega.kernels.errors import DtmegaError
from dtmega.train.args import ArgumentError
from dtmega.train.checkpoint import CheckpointError, load_checkpoint, read_state, resolve_checkpoint
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 6-step run saving at steps 3 and 6 (its corpus, its checkpoint directory, its losses)."""
    root = tmp_path_factory.mktemp("load_flags")
    corpus = prepare_corpus(root, documents=120)
    save = root / "ckpt"
    result = train(tiny_args(corpus, train_iters=6, save_interval=3, save=str(save), eval_iters=0, log_interval=1))
    return corpus, save, result.losses


def _resume(corpus, load, tmp_path, **flags):
    return train(tiny_args(corpus, train_iters=6, load=str(resolve_checkpoint(load).parent / "iter_0000003"),
                           save=str(tmp_path / "again"), eval_iters=0, log_interval=1, **flags))


def test_a_plain_resume_reproduces_the_uninterrupted_losses(run, tmp_path):
    corpus, save, losses = run
    assert _resume(corpus, save, tmp_path).losses == pytest.approx(losses[3:], rel=1e-5)


def test_no_load_optim_resumes_the_step_and_data_with_a_fresh_optimizer(run, tmp_path):
    """Step 4's loss is computed from the loaded weights, before any update: equal to the
    uninterrupted run's. Step 5 follows an update by a fresh AdamW (no moments, step count 1),
    so it differs from the run that kept its optimizer."""
    corpus, save, losses = run
    resumed = _resume(corpus, save, tmp_path, no_load_optim=True).losses
    assert len(resumed) == 3
    assert resumed[0] == pytest.approx(losses[3], rel=1e-5)
    assert abs(resumed[1] - losses[4]) > 1e-4 * abs(losses[4])


def test_finetune_starts_from_the_weights_at_step_0(run, tmp_path):
    """--finetune: six steps from iteration 0 over the data from its start, on the trained
    weights: its first loss (the first batch again) is below the first loss of the run that
    trained them from random weights."""
    corpus, save, losses = run
    tuned = train(tiny_args(corpus, train_iters=6, load=str(save), finetune=True, save=str(tmp_path / "tuned"),
                            eval_iters=0, log_interval=1))
    assert len(tuned.losses) == 6
    assert tuned.losses[0] < losses[0] - 0.1
    assert read_state(resolve_checkpoint(tmp_path / "tuned"))["iteration"] == 6


def test_no_save_optim_writes_no_optimizer_and_its_resume_says_what_to_add(run, tmp_path):
    corpus, _, losses = run
    save = tmp_path / "light"
    light = train(tiny_args(corpus, train_iters=6, save_interval=3, save=str(save), eval_iters=0, log_interval=1,
                            no_save_optim=True))
    assert light.losses == pytest.approx(losses, rel=1e-5)  # saving less changes nothing in the run
    checkpoint = save / "iter_0000003"
    assert read_state(checkpoint)["optimizer_saved"] is False
    assert any(name.startswith("model") for name in _dcp_keys(checkpoint))
    assert not any(name.startswith("optimizer") for name in _dcp_keys(checkpoint))
    with pytest.raises(CheckpointError, match="saved without the optimizer state.*Fix: add --no-load-optim"):
        train(tiny_args(corpus, train_iters=6, load=str(checkpoint), save=str(tmp_path / "on"), eval_iters=0))
    resumed = train(tiny_args(corpus, train_iters=6, load=str(checkpoint), save=str(tmp_path / "on"), eval_iters=0,
                              log_interval=1, no_load_optim=True))
    assert resumed.losses[0] == pytest.approx(losses[3], rel=1e-5)


def test_no_load_rng_leaves_the_random_state_alone(run):
    """load_checkpoint restores each rank's saved generator unless told not to (the trainer passes
    --no-load-rng and --finetune through as restore_rng=False)."""
    _, save, _ = run
    from dtmega.train.restore import restore

    checkpoint = resolve_checkpoint(save)
    model = restore(save)[0].module
    torch.manual_seed(99)
    before = torch.get_rng_state()
    load_checkpoint(checkpoint, model, restore_rng=False)
    assert torch.equal(torch.get_rng_state(), before)
    load_checkpoint(checkpoint, model)
    assert not torch.equal(torch.get_rng_state(), before)


def test_loading_flags_without_load_are_refused(run):
    corpus, _, _ = run
    with pytest.raises(ArgumentError, match="--finetune, --no-load-rng say\\(s\\) how to load --load, which is not"):
        train(tiny_args(corpus, train_iters=2, finetune=True, no_load_rng=True))


def _dcp_keys(checkpoint) -> list[str]:
    from dtmega.checkpoint_reader import read_dcp_metadata

    return list(read_dcp_metadata(checkpoint).state_dict_metadata)


def test_exit_interval_saves_and_stops_and_the_restart_finishes_the_same_run(run, tmp_path):
    """--exit-interval 4 on the 6-step run: it saves step 4 and stops (exit status 0 from the
    command); a restart with the same line minus the flag trains steps 5-6 with the uninterrupted
    losses."""
    corpus, _, losses = run
    save = tmp_path / "ckpt"
    line = dict(train_iters=6, save_interval=3, save=str(save), eval_iters=0, log_interval=1)
    first = train(tiny_args(corpus, exit_interval=4, **line))
    assert first.iteration == 4 and first.losses == pytest.approx(losses[:4], rel=1e-5)
    assert resolve_checkpoint(save).name == "iter_0000004"
    rest = train(tiny_args(corpus, load=str(save), **line))
    assert rest.losses == pytest.approx(losses[4:], rel=1e-5)


def test_exit_duration_stops_at_the_first_step_past_it_with_a_checkpoint(run, tmp_path):
    corpus, _, _ = run
    save = tmp_path / "ckpt"
    done = train(tiny_args(corpus, train_iters=6, save=str(save), eval_iters=0, exit_duration_in_mins=1e-9))
    assert done.iteration == 1 and resolve_checkpoint(save).name == "iter_0000001"


def test_the_final_checkpoint_is_saved_before_the_final_validation(run, tmp_path, monkeypatch):
    """A final validation that fails (or is killed) leaves the run's last checkpoint on disk."""
    corpus, _, _ = run
    from dtmega.train import trainer as trainer_module

    def validation_dies(*_args, **_kwargs):
        raise KeyboardInterrupt("killed during the final validation")

    monkeypatch.setattr(trainer_module, "evaluate_loss", validation_dies)
    save = tmp_path / "ckpt"
    with pytest.raises(KeyboardInterrupt):
        train(tiny_args(corpus, train_iters=3, eval_interval=100, eval_iters=2, save=str(save)))
    assert resolve_checkpoint(save).name == "iter_0000003"


def test_params_norm_and_zeros_in_grad_are_logged(run, tmp_path):
    """--log-params-norm logs the norm of every parameter as if unsharded: at the last step it is
    the norm of the saved weights. --log-num-zeros-in-grad logs a whole count, at most the
    number of gradient entries."""
    import json

    from dtmega.train.restore import restore

    corpus, _, _ = run
    save, log = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    train(tiny_args(corpus, train_iters=3, save=str(save), eval_iters=0, log_interval=1, log_file=str(log),
                    log_params_norm=True, log_num_zeros_in_grad=True))
    records = [json.loads(line) for line in log.read_text().splitlines() if '"params_norm"' in line]
    assert [r["step"] for r in records] == [1, 2, 3]
    model = restore(save)[0].module
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert records[-1]["params_norm"] == pytest.approx(float(weights.norm()), rel=1e-5)
    assert all(isinstance(r["num_zeros_in_grad"], int) and 0 <= r["num_zeros_in_grad"] < weights.numel()
               for r in records)


def test_exit_signal_handler_saves_on_sigterm_exits_0_and_the_restart_resumes_the_same_losses(run, tmp_path):
    """A preemption: SIGTERM to `dtmega train --exit-signal-handler` mid-run. The step under way
    finishes, the run saves it and exits 0 (without the flag: status 143, nothing saved beyond the
    last checkpoint). Restarted with the same line, it continues with the losses of a run never
    interrupted (constant learning rate; every run stops with --exit-interval two steps later)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    corpus, _, _ = run
    save, log = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    line = dict(train_iters=300, lr_decay_style="constant", lr_warmup_iters=0, eval_iters=0, log_interval=1)
    argv = tiny_args(corpus, save=str(save), save_interval=1000, log_file=str(log), exit_signal_handler=True, **line)
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen([sys.executable, "-m", "dtmega", "train", *argv], cwd=root, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (not log.exists() or log.read_text().count("\n") < 2):
        assert process.poll() is None, process.communicate()
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, err[-3000:]
    steps = [json.loads(x)["step"] for x in log.read_text().splitlines() if '"loss"' in x]
    stopped = steps[-1]
    assert 2 <= stopped < 300 and f"stopping at step {stopped}: SIGTERM received" in out + err
    assert resolve_checkpoint(save).name == f"iter_{stopped:07d}"
    resumed = train(tiny_args(corpus, load=str(save), save=str(save), exit_interval=stopped + 2, **line))
    reference = train(tiny_args(corpus, exit_interval=stopped + 2, **line))
    assert len(resumed.losses) == 2
    assert resumed.losses == pytest.approx(reference.losses[-2:], rel=1e-5)


def test_manual_gc_turns_the_collector_off_and_collects_at_its_interval_and_around_validations(run, monkeypatch):
    """--manual-gc --manual-gc-interval 2 over 4 steps validating at 2 and 4: the automatic
    collector is off during the run and back on after it; collections at steps 2 and 4 and
    before and after each of the two validations (6); none of the latter with --no-manual-gc-eval."""
    from dtmega.train import memory_hygiene
    from dtmega.train import trainer as trainer_module

    class Collector:
        def __init__(self):
            self.enabled, self.collections, self.seen_disabled = True, 0, False

        def isenabled(self):
            return self.enabled

        def disable(self):
            self.enabled = False

        def enable(self):
            self.enabled = True

        def collect(self):
            self.collections += 1
            self.seen_disabled |= not self.enabled

    corpus, _, _ = run
    for flags, expected in (({}, 6), ({"no_manual_gc_eval": True}, 2)):
        spy = Collector()
        monkeypatch.setattr(trainer_module, "gc", spy)  # turns the collector off and on
        monkeypatch.setattr(memory_hygiene, "gc", spy)  # collects
        train(tiny_args(corpus, train_iters=4, eval_interval=2, eval_iters=1, manual_gc=True, manual_gc_interval=2,
                        **flags))
        assert spy.collections == expected and spy.seen_disabled and spy.enabled


def test_grad_reduce_in_bf16_reduces_gradients_in_bf16():
    from dtmega.passes import DataParallel
    from dtmega.train.args import parse_train_args
    from dtmega.train.setup import build_plan, run_shape

    args = parse_train_args(["--grad-reduce-in-bf16", "--bf16", "--use-distributed-optimizer"])[0]
    (data,) = [p for p in build_plan(args, run_shape(args, 4), 2).passes if isinstance(p, DataParallel)]
    assert (data.mode, data.param_dtype, data.reduce_dtype) == ("fsdp", "bfloat16", "bfloat16")


def _lrs(path) -> list[float]:
    import json

    return [record["lr"] for record in map(json.loads, path.read_text().splitlines()) if "lr" in record]


def test_a_resume_that_changes_the_schedule_is_refused_unless_told_which_to_follow(run, tmp_path):
    """Megatron's scheduler check: the checkpoint records its schedule; a resume whose flags give
    another one is refused naming what changed; --override-opt_param-scheduler follows the new
    flags from the samples already trained, --use-checkpoint-opt_param-scheduler the checkpoint's
    (which then repeats the uninterrupted run)."""
    corpus, save, losses = run
    with pytest.raises(DtmegaError, match=r"--lr: 0.003 in the checkpoint, 0.002 now.*--override-opt_param-scheduler"):
        _resume(corpus, save, tmp_path, lr=2e-3, override_opt_param_scheduler=False)
    kept = _resume(corpus, save, tmp_path / "kept", lr=2e-3, use_checkpoint_opt_param_scheduler=True,
                   log_file=str(tmp_path / "kept.jsonl"))
    assert kept.losses == pytest.approx(losses[3:], rel=1e-5)
    moved = _resume(corpus, save, tmp_path / "moved", lr=2e-3, override_opt_param_scheduler=True,
                    log_file=str(tmp_path / "moved.jsonl"))
    from dtmega.train.args import parse_train_args

    schedule = parse_train_args(tiny_args(corpus, train_iters=6, lr=2e-3))[0].schedules(8)
    assert _lrs(tmp_path / "moved.jsonl") == [schedule.lr(8 * step) for step in (4, 5, 6)]
    assert moved.losses[0] == pytest.approx(losses[3], rel=1e-5)  # step 4's loss is before its update


def test_no_load_optim_starts_the_schedule_afresh_as_megatron(run, tmp_path):
    """Megatron loads its scheduler with the optimizer: --no-load-optim resumes the step and the
    data, with the schedule from its start (the warmup's first rate: 0, no update at step 4)."""
    corpus, save, losses = run
    _resume(corpus, save, tmp_path, no_load_optim=True, log_file=str(tmp_path / "m.jsonl"))
    from dtmega.train.args import parse_train_args

    schedule = parse_train_args(tiny_args(corpus, train_iters=6))[0].schedules(8)
    assert _lrs(tmp_path / "m.jsonl") == [schedule.lr(8 * step) for step in (1, 2, 3)]
