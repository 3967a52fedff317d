"""Megatron's run-length and schedule flags: --train-samples and the --lr-*-samples schedule,
--lr-warmup-fraction, --lr-warmup-init, and the weight-decay schedule (--start-weight-decay,
--end-weight-decay, --weight-decay-incr-style), against Megatron's formulas and against the
iteration-based spelling of the same numbers."""

from __future__ import annotations

import math

import pytest

from dtmega.train.args import ArgumentError, parse_train_args
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args

BASE = ["--lr", "1e-3", "--min-lr", "1e-4", "--global-batch-size", "8"]


def _schedules(*flags: str):
    args = parse_train_args([*BASE, *flags])[0]
    args.check_schedule()
    return args.total_steps(8), *args.schedules(8)


@pytest.mark.parametrize("style", ["linear", "cosine", "WSD", "constant"])
def test_a_sample_based_schedule_equals_the_iteration_based_one_for_the_same_numbers(style):
    """800 samples of global batch 8 = 100 steps; decay over 640 samples = 80 steps; warmup 80
    samples = 10 steps; WSD's final decay 160 samples = 20 steps: the same learning rate at
    every step, to the last bit of a float division."""
    wsd = ("--lr-wsd-decay-iters", "20") if style == "WSD" else ()
    wsd_samples = ("--lr-wsd-decay-samples", "160") if style == "WSD" else ()
    steps, by_iters, _ = _schedules("--train-iters", "100", "--lr-decay-iters", "80", "--lr-warmup-iters", "10",
                                    "--lr-decay-style", style, *wsd)
    samples_steps, by_samples, _ = _schedules("--train-samples", "800", "--lr-decay-samples", "640",
                                              "--lr-warmup-samples", "80", "--lr-decay-style", style, *wsd_samples)
    assert steps == samples_steps == 100
    for step in range(1, 101):
        assert by_samples(step) == pytest.approx(by_iters(step), rel=1e-12, abs=1e-15), step
    assert by_iters(5) == pytest.approx(1e-3 * 5 / 10)  # warmup from 0
    if style != "constant":
        assert by_iters(100) == pytest.approx(1e-4)  # past the decay: min_lr


def test_train_samples_rounds_down_to_whole_steps_and_decays_over_them_by_default():
    steps, schedule, _ = _schedules("--train-samples", "803")
    assert steps == 100  # Megatron: train_iters = train_samples // global batch
    assert schedule.decay_steps == pytest.approx(803 / 8)


def test_warmup_fraction_and_warmup_init_follow_megatron():
    _, schedule, _ = _schedules("--train-iters", "100", "--lr-decay-iters", "80", "--lr-warmup-fraction", "0.1",
                                "--lr-warmup-init", "2e-4")
    assert schedule.warmup_steps == pytest.approx(8.0)  # a fraction of the decay steps, as Megatron
    # warmup: init + (max - init) * step / warmup steps
    for step in (1, 4, 8):
        assert schedule(step) == pytest.approx(2e-4 + (1e-3 - 2e-4) * step / 8)
    _, by_samples, _ = _schedules("--train-samples", "800", "--lr-decay-samples", "640", "--lr-warmup-fraction", "0.1")
    assert by_samples.warmup_steps == pytest.approx(8.0)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_rises_from_start_to_end_over_the_run(style):
    steps, _, decay = _schedules("--train-iters", "100", "--start-weight-decay", "0.0", "--end-weight-decay", "0.2",
                                 "--weight-decay-incr-style", style)
    for step in (1, 25, 50, 75, 100):
        ratio = step / 100
        coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1)  # Megatron's get_wd
        assert decay(step) == pytest.approx(0.2 * coeff)
    assert decay(101) == 0.2
    _, _, by_samples = _schedules("--train-samples", "800", "--start-weight-decay", "0.0", "--end-weight-decay",
                                  "0.2", "--weight-decay-incr-style", style)
    assert [by_samples(s) for s in range(1, 101)] == pytest.approx([decay(s) for s in range(1, 101)])


def test_constant_weight_decay_is_weight_decay_or_the_equal_start_and_end():
    assert _schedules("--train-iters", "10", "--weight-decay", "0.05")[2](7) == 0.05
    same = _schedules("--train-iters", "10", "--start-weight-decay", "0.1", "--end-weight-decay", "0.1",
                      "--weight-decay-incr-style", "constant")[2]
    assert same(1) == same(10) == 0.1


@pytest.mark.parametrize("flags, message", [
    (["--train-iters", "10", "--train-samples", "80"], "--train-iters and --train-samples both give"),
    (["--train-samples", "80", "--lr-decay-iters", "5"], r"--lr-decay-iters count iters, but the run's length is "
                                                         r"given in samples \(--train-samples\)"),
    (["--train-iters", "10", "--lr-warmup-samples", "8"], "--lr-warmup-samples count samples"),
    (["--train-iters", "10", "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"],
     "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples both"),
    (["--train-iters", "10", "--lr-warmup-init", "0.1"], r"--lr-warmup-init 0.1 is above --lr 0.001"),
    (["--train-iters", "10", "--start-weight-decay", "0", "--end-weight-decay", "0.1"],
     "differ, but --weight-decay-incr-style is constant"),
    (["--train-iters", "10", "--weight-decay-incr-style", "linear"], "needs --start-weight-decay and"),
    (["--train-samples", "4"], "less than one global batch"),
    (["--train-samples", "80", "--lr-warmup-samples", "80"], "must be longer than its warmup"),
])
def test_contradicting_schedule_flags_are_refused_naming_them(flags, message):
    with pytest.raises(ArgumentError, match=message):
        _schedules(*flags)


def test_a_run_given_in_samples_trains_exactly_as_the_run_given_in_iterations(tmp_path):
    """The trainer end to end: 12 steps spelled as --train-iters 12 / warmup 3 / decay 10, and as
    --train-samples 96 / warmup 24 / decay 80 samples (global batch 8): the same losses and
    learning rates at every step."""
    corpus = prepare_corpus(tmp_path, documents=120)
    common = dict(eval_iters=0, log_interval=1, weight_decay=None)
    by_iters = train(tiny_args(corpus, train_iters=12, lr_warmup_iters=3, lr_decay_iters=10,
                               start_weight_decay=0.0, end_weight_decay=0.1, weight_decay_incr_style="linear",
                               log_file=str(tmp_path / "iters.jsonl"), **common))
    by_samples = train(tiny_args(corpus, train_iters=None, train_samples=96, lr_warmup_iters=None,
                                 lr_warmup_samples=24, lr_decay_samples=80, start_weight_decay=0.0,
                                 end_weight_decay=0.1, weight_decay_incr_style="linear",
                                 log_file=str(tmp_path / "samples.jsonl"), **common))
    assert len(by_iters.losses) == len(by_samples.losses) == 12
    assert by_samples.losses == pytest.approx(by_iters.losses, rel=1e-6)
    lrs = [(tmp_path / name).read_text() for name in ("iters.jsonl", "samples.jsonl")]
    assert lrs[0].count('"lr"') == 12 and _lrs(lrs[0]) == pytest.approx(_lrs(lrs[1]), rel=1e-12)


def _lrs(text: str) -> list[float]:
    import json

    return [json.loads(line)["lr"] for line in text.splitlines() if '"lr"' in line]
