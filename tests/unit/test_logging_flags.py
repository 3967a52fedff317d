"""Megatron's logging flags, read back from what the run wrote: TensorBoard's event files (through
tensorboard's own reader), a real offline Weights & Biases run file (tests/wandb_records.py),
and metrics.jsonl.

--tensorboard-log-interval N: each N-th step's own loss (equal to the run's per-step loss, the
float32 TensorBoard stores: rel 1e-6), the --log-interval records for the rest;
--log-timers-to-tensorboard and --timing-log-level: the timers in the sinks only when asked, the
phases only from level 1; --log-world-size-to-tensorboard; W&B: name, project, config and every
record at its step; bad W&B settings refused before any work, with the fix."""

from __future__ import annotations

import importlib.util
import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dtmega.train.args import ArgumentError
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args
from tests.wandb_records import read_run


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("logging"), documents=120)


def _board(directory) -> dict[str, dict[int, float]]:
    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: {event.step: event.value for event in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tensorboard_gets_each_nth_steps_own_values_and_the_timers_asked_for(corpus, tmp_path):
    result = train(tiny_args(corpus, train_iters=6, log_interval=3, eval_iters=0, tensorboard_dir=str(tmp_path / "tb"),
                             tensorboard_log_interval=2, log_timers_to_tensorboard=True, timing_log_level=1,
                             log_world_size_to_tensorboard=True, log_file=str(tmp_path / "m.jsonl")))
    board = _board(tmp_path / "tb")
    assert sorted(board["train/loss"]) == [2, 4, 6]
    for step, value in board["train/loss"].items():
        assert value == pytest.approx(result.losses[step - 1], rel=1e-6)
    assert sorted(board["train/lr"]) == [2, 4, 6] and sorted(board["train/tokens_per_s"]) == [3, 6]
    for timer in ("iteration_ms", "data_ms_max", "data_ms_min", "forward_backward_ms_max", "optimizer_ms_max"):
        assert sorted(board[f"train/{timer}"]) == [3, 6], timer
    assert "train/grad_norm_ms_max" not in board  # level 2 only
    assert board["train/world_size"] == {3: 1.0, 6: 1.0}
    records = _jsonl(tmp_path / "m.jsonl")
    assert [r["step"] for r in records] == [3, 6] and all(r["forward_backward_ms_max"] > 0 for r in records)


def test_timers_stay_out_of_tensorboard_unless_asked_and_level_2_splits_the_norm(corpus, tmp_path):
    train(tiny_args(corpus, train_iters=4, log_interval=2, eval_iters=0, tensorboard_dir=str(tmp_path / "tb"),
                    timing_log_level=2, timing_log_option="all", log_file=str(tmp_path / "m.jsonl")))
    board = _board(tmp_path / "tb")
    assert sorted(board["train/loss"]) == [2, 4]  # the --log-interval records carry the loss by default
    assert not [tag for tag in board if "_ms" in tag], sorted(board)
    record = _jsonl(tmp_path / "m.jsonl")[-1]
    assert record["iteration_ms"] > 0
    assert [len(record[f"{name}_ms_ranks"]) for name in ("data", "forward_backward", "grad_norm", "optimizer")] == [1] * 4


def test_an_offline_wandb_run_holds_the_config_and_every_record(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = train(tiny_args(corpus, train_iters=4, log_interval=2, eval_interval=2, eval_iters=1,
                             save=str(tmp_path / "ckpt"), wandb_project="dtmega-tests", wandb_exp_name="tiny",
                             log_file=str(tmp_path / "m.jsonl")))
    run = read_run(tmp_path / "ckpt" / "wandb")  # Megatron's default: --save's wandb/
    assert (run["name"], run["project"]) == ("tiny", "dtmega-tests")
    assert run["config"]["lr"] == pytest.approx(3e-3) and run["config"]["train_iters"] == 4
    for record in _jsonl(tmp_path / "m.jsonl"):
        row = run["history"][record["step"]]
        prefix = "valid" if "val_loss" in record else "train"
        for key, value in record.items():
            if key == "iteration_ms":  # a timer: in the sinks only with --log-timers-to-tensorboard
                assert f"{prefix}/{key}" not in row
            elif key != "step" and isinstance(value, (int, float)):
                assert row[f"{prefix}/{key}"] == pytest.approx(value, rel=1e-12), key
    assert [run["history"][step]["train/loss"] for step in (2, 4)] == \
        pytest.approx([sum(result.losses[:2]) / 2, sum(result.losses[2:]) / 2], rel=1e-6)


@pytest.mark.parametrize("flags, message", [
    (dict(wandb_exp_name="x"), r"--wandb-exp-name needs --wandb-project.*Fix: add --wandb-project NAME"),
    (dict(wandb_project="p"), r"--wandb-project needs a directory.*Fix: add --wandb-save-dir DIR"),
])
def test_wandb_settings_that_cannot_log_are_refused_by_a_dry_run(corpus, flags, message):
    with pytest.raises(ArgumentError, match=message):
        train(tiny_args(corpus, dry_run=1, **flags))


def test_wandb_not_installed_is_refused_naming_the_package(corpus, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ArgumentError, match=r"wandb package, which is not installed.*pip install 'dtmega\[wandb\]'"):
        train(tiny_args(corpus, dry_run=1, wandb_project="p", wandb_save_dir=str(tmp_path)))


def test_an_online_wandb_run_without_a_login_is_refused_with_the_fix(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no stored key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with pytest.raises(ArgumentError, match=r"could not start a run.*Fix: `wandb login`.*WANDB_MODE=offline"):
        train(tiny_args(corpus, train_iters=2, eval_iters=0, wandb_project="p", wandb_save_dir=str(tmp_path / "w")))


def test_flags_with_nothing_to_write_to_get_a_note(corpus, capsys):
    train(tiny_args(corpus, dry_run=1, log_timers_to_tensorboard=True))
    assert "--log-timers-to-tensorboard has nothing to write to" in capsys.readouterr().out
