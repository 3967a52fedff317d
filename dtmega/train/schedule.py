"""Learning-rate and weight-decay schedules as Megatron-Core's OptimizerParamScheduler runs them
(megatron/core/optimizer_param_scheduler.py, 0.16; built by training.py's
get_optimizer_param_scheduler):

- the schedule counts *samples* of successful updates (`num_steps`): iteration-based lengths are
  iterations x the global batch, sample-based ones are taken as given;
- the learning rate of a step is the schedule at the samples consumed *before* it, so the first
  step runs at the warmup's start (--lr-warmup-init, 0 by default: no update), and a skipped
  step does not advance the schedule;
- what Megatron logs as a step's learning rate is the one set after that step's update (the next
  step's), `lr(num_steps)` after the step's samples are counted.

Warmup is linear from --lr-warmup-init; then constant, linear, cosine, inverse-square-root, or WSD
(warmup-stable-decay: the rate stays until the last --lr-wsd-decay-iters/-samples, then anneals
by --lr-wsd-decay-style, exponential by default as in Megatron); min_lr after the decay. Weight
decay is constant, or rises from --start-weight-decay to --end-weight-decay over the run (linear
or cosine), never on norms and biases. Every formula is Megatron's, in the same floating-point
order, so the learning rates are Megatron's to the last bit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dtmega.kernels.errors import DtmegaError

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclass(frozen=True)
class ParamSchedule:
    """Megatron's schedule, every length in samples; `lr(n)` and `weight_decay(n)` after n
    samples of successful updates."""

    init_lr: float
    max_lr: float
    min_lr: float
    warmup_steps: float
    decay_steps: float
    style: str = "linear"
    wsd_decay_steps: float | None = None
    wsd_style: str = "exponential"
    start_wd: float = 0.01
    end_wd: float = 0.01
    wd_incr_steps: float = 1.0
    wd_incr_style: str = "constant"

    def __post_init__(self) -> None:
        if self.style not in DECAY_STYLES:
            raise DtmegaError(f"--lr-decay-style {self.style!r} is unknown; choose one of {', '.join(DECAY_STYLES)}")
        if self.min_lr > self.max_lr:
            raise DtmegaError(f"--min-lr {self.min_lr} is above --lr {self.max_lr}. Fix: a --min-lr of at most --lr")
        if self.decay_steps <= 0 or self.warmup_steps >= self.decay_steps:
            raise DtmegaError(f"the learning-rate decay ({self.decay_steps:g} samples) must be longer than its warmup "
                              f"({self.warmup_steps:g} samples). Fix: a longer --lr-decay-iters/--lr-decay-samples, "
                              "or a shorter warmup")
        if self.style == "WSD" and not self.wsd_decay_steps:
            raise DtmegaError("--lr-decay-style WSD needs the length of its final decay. Fix: --lr-wsd-decay-iters "
                              "(or --lr-wsd-decay-samples with --train-samples)")

    def lr(self, num_steps: float) -> float:
        """The learning rate after `num_steps` samples (OptimizerParamScheduler.get_lr)."""
        if self.warmup_steps > 0 and num_steps <= self.warmup_steps:
            return self.init_lr + ((self.max_lr - self.init_lr) * float(num_steps) / float(self.warmup_steps))
        if self.style == "constant":
            return self.max_lr
        if num_steps > self.decay_steps:
            return self.min_lr
        if self.style == "inverse-square-root":
            warmup = max(self.warmup_steps, 1)
            lr = self.max_lr * warmup ** 0.5 / (max(num_steps, 1) ** 0.5)
            return max(self.min_lr, lr)
        decay_ratio = float(num_steps - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        delta = self.max_lr - self.min_lr
        if self.style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:  # WSD
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if num_steps <= anneal_start:
                coeff = 1.0
            else:
                ratio = float(num_steps - anneal_start) / float(self.wsd_decay_steps)
                coeff = {"linear": lambda r: 1.0 - r, "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": lambda r: (2.0 * math.pow(0.5, r)) - 1.0,
                         "minus_sqrt": lambda r: 1.0 - math.sqrt(r)}[self.wsd_style](ratio)
        return self.min_lr + coeff * delta

    def weight_decay(self, num_steps: float) -> float:
        """The weight decay after `num_steps` samples (OptimizerParamScheduler.get_wd)."""
        if num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = float(num_steps) / float(self.wd_incr_steps)
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def state(self) -> dict:
        """The settings a checkpoint records (to check a resume against, as Megatron does)."""
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> "ParamSchedule":
        """A schedule a checkpoint recorded."""
        return cls(**state)


# The settings a resume compares, by the flags that set them (Megatron's _check_and_set names).
CHECKED = {"max_lr": "--lr", "min_lr": "--min-lr", "warmup_steps": "--lr-warmup-*", "decay_steps": "--lr-decay-*",
           "style": "--lr-decay-style", "start_wd": "--start-weight-decay/--weight-decay",
           "end_wd": "--end-weight-decay/--weight-decay", "wd_incr_steps": "the run's length",
           "wd_incr_style": "--weight-decay-incr-style"}


def resumed_schedule(flags: ParamSchedule, saved: dict | None, override: bool, use_checkpoint: bool) -> tuple[
        ParamSchedule, str | None]:
    """The schedule a resumed run follows and what to say about it: Megatron's rule (a changed
    setting is refused unless --override-opt_param-scheduler takes the flags' values or
    --use-checkpoint-opt_param-scheduler the checkpoint's). A checkpoint that recorded no
    schedule (written before dtmega recorded it) follows the flags."""
    if saved is None or override:
        return flags, None
    recorded = ParamSchedule.from_state(saved)
    if use_checkpoint:
        return recorded, "the learning-rate schedule is the checkpoint's (--use-checkpoint-opt_param-scheduler)"
    changed = [f"{CHECKED[name]}: {getattr(recorded, name)!r} in the checkpoint, {getattr(flags, name)!r} now"
               for name in CHECKED if getattr(recorded, name) != getattr(flags, name)]
    if changed:
        raise DtmegaError("this resume changes the learning-rate schedule the checkpoint was trained with ("
                          + "; ".join(changed) + "). Fix: --override-opt_param-scheduler to follow the new flags, "
                          "--use-checkpoint-opt_param-scheduler to keep the checkpoint's, or the flags it was "
                          "trained with")
    return recorded, None
