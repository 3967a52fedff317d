"""Megatron's run-length and schedule flags: --train-samples and the --lr-*-samples schedule,
--lr-warmup-fraction, --lr-warmup-init, every --lr-decay-style, and the weight-decay schedule
(--start-weight-decay, --end-weight-decay, --weight-decay-incr-style), against megatron-core's own
OptimizerParamScheduler and against the iteration-based spelling of the same numbers."""

from __future__ import annotations

import pytest

from dtmega.train.args import ArgumentError, parse_train_args
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args

BASE = ["--lr", "1e-3", "--min-lr", "1e-4", "--global-batch-size", "8"]


def _schedules(*flags: str):
    args = parse_train_args([*BASE, *flags])[0]
    args.check_schedule()
    return args.total_steps(8), args.schedules(8)


def megatron_scheduler(**kwargs):
    """megatron-core's OptimizerParamScheduler over one stand-in parameter group."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Groups:
        param_groups = [{}]

    return OptimizerParamScheduler(Groups(), **kwargs), Groups.param_groups[0]


MEGATRON_LINES = {
    # dtmega flags -> what training.py's get_optimizer_param_scheduler gives megatron-core (global batch 8)
    "linear warmup": (["--train-iters", "100", "--lr-decay-iters", "80", "--lr-warmup-iters", "10"],
                      dict(lr_warmup_steps=80, lr_decay_steps=640, lr_decay_style="linear", wd_incr_steps=800)),
    "cosine warmup init": (["--train-iters", "100", "--lr-warmup-iters", "7", "--lr-decay-style", "cosine",
                            "--lr-warmup-init", "2e-4"],
                           dict(init_lr=2e-4, lr_warmup_steps=56, lr_decay_steps=800, lr_decay_style="cosine",
                                wd_incr_steps=800)),
    "WSD": (["--train-iters", "100", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "20", "--lr-warmup-iters",
             "5"], dict(lr_warmup_steps=40, lr_decay_steps=800, lr_decay_style="WSD", wsd_decay_steps=160,
                        lr_wsd_decay_style="exponential", wd_incr_steps=800)),
    "WSD minus_sqrt": (["--train-iters", "100", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "30",
                        "--lr-wsd-decay-style", "minus_sqrt"],
                       dict(lr_warmup_steps=0, lr_decay_steps=800, lr_decay_style="WSD", wsd_decay_steps=240,
                            lr_wsd_decay_style="minus_sqrt", wd_incr_steps=800)),
    "inverse square root": (["--train-iters", "100", "--lr-warmup-iters", "10", "--lr-decay-style",
                             "inverse-square-root"],
                            dict(lr_warmup_steps=80, lr_decay_steps=800, lr_decay_style="inverse-square-root",
                                 wd_incr_steps=800)),
    "constant": (["--train-iters", "100", "--lr-warmup-iters", "10", "--lr-decay-style", "constant"],
                 dict(lr_warmup_steps=80, lr_decay_steps=800, lr_decay_style="constant", wd_incr_steps=800)),
    "samples, fraction": (["--train-samples", "803", "--lr-decay-samples", "700", "--lr-warmup-fraction", "0.13",
                           "--lr-decay-style", "cosine"],
                          dict(lr_warmup_steps=0.13 * 700, lr_decay_steps=700, lr_decay_style="cosine",
                               wd_incr_steps=803)),
    "cosine weight decay": (["--train-iters", "100", "--start-weight-decay", "0.0", "--end-weight-decay", "0.2",
                             "--weight-decay-incr-style", "cosine"],
                            dict(lr_warmup_steps=0, lr_decay_steps=800, lr_decay_style="linear", start_wd=0.0,
                                 end_wd=0.2, wd_incr_steps=800, wd_incr_style="cosine")),
}


@pytest.mark.parametrize("name", MEGATRON_LINES)
def test_the_schedule_is_megatron_cores_to_the_last_bit(name):
    """Every sample count of the run: dtmega's learning rate and weight decay equal megatron-core's
    OptimizerParamScheduler built as training.py builds it, stepped by the global batch."""
    flags, built = MEGATRON_LINES[name]
    _, ours = _schedules(*flags)
    wd = {"start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant", **built}
    theirs, group = megatron_scheduler(**{"init_lr": 0.0, "max_lr": 1e-3, "min_lr": 1e-4, **wd})
    for num_steps in range(0, 900, 8):
        assert ours.lr(num_steps) == group["lr"], num_steps
        assert ours.weight_decay(num_steps) == group["weight_decay"], num_steps
        theirs.step(8)


def test_a_sample_based_schedule_equals_the_iteration_based_one_for_the_same_numbers():
    """800 samples of global batch 8 = 100 steps; decay over 640 samples = 80 steps; warmup 80
    samples = 10 steps: the same schedule."""
    steps, by_iters = _schedules("--train-iters", "100", "--lr-decay-iters", "80", "--lr-warmup-iters", "10",
                                 "--lr-decay-style", "cosine")
    samples_steps, by_samples = _schedules("--train-samples", "800", "--lr-decay-samples", "640",
                                           "--lr-warmup-samples", "80", "--lr-decay-style", "cosine")
    assert steps == samples_steps == 100 and by_iters == by_samples


def test_train_samples_rounds_down_to_whole_steps_and_decays_over_them_by_default():
    steps, schedule = _schedules("--train-samples", "803")
    assert steps == 100  # Megatron: train_iters = train_samples // global batch
    assert schedule.decay_steps == 803


def test_the_first_step_runs_at_the_warmups_start_and_the_log_shows_the_next_rate():
    """Megatron steps its scheduler after the update: step 1 runs at --lr-warmup-init (0: no
    update), and the lr a step logs is the one set after it. dtmega set the rate of step k+1
    before step k (every rate one step early)."""
    _, schedule = _schedules("--train-iters", "100", "--lr-warmup-iters", "10")
    assert schedule.lr(0) == 0.0 and schedule.lr(8) == pytest.approx(1e-4)  # step 1's rate, step 1's logged rate


def test_wsd_needs_its_decay_length_as_megatron_does():
    with pytest.raises(ArgumentError, match="--lr-wsd-decay-iters"):
        _schedules("--train-iters", "100", "--lr-decay-style", "WSD")


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
    (["--train-iters", "10", "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
     "contradict each other"),
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
