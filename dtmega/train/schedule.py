"""Learning-rate and weight-decay schedules with Megatron's semantics: linear warmup from
--lr-warmup-init (0 by default), then constant, linear, cosine or WSD (warmup-stable-decay) down
to min_lr at the decay's end; weight decay constant, or rising from --start-weight-decay to
--end-weight-decay over the run (linear or cosine).

Lengths are in optimizer steps and may be fractional: a sample-based schedule (--train-samples,
--lr-decay-samples, --lr-warmup-samples, --lr-warmup-fraction) is the same schedule with its
sample counts divided by the global batch, so equal numbers give equal learning rates."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtmega.kernels.errors import DtmegaError


@dataclass
class LRSchedule:
    """lr(step) for step = 1, 2, ... (the step about to be taken)."""

    max_lr: float
    min_lr: float
    warmup_steps: float
    decay_steps: float
    style: str = "linear"
    wsd_decay_steps: float | None = None
    wsd_style: str = "linear"
    init_lr: float = 0.0  # where the warmup starts (--lr-warmup-init)

    def __post_init__(self) -> None:
        if self.style not in ("constant", "linear", "cosine", "WSD"):
            raise DtmegaError(f"--lr-decay-style {self.style!r} is unknown")
        if self.min_lr > self.max_lr:
            raise DtmegaError(f"--min-lr {self.min_lr} is above --lr {self.max_lr}")
        if self.style != "constant" and self.decay_steps <= self.warmup_steps:
            raise DtmegaError(
                f"--lr-decay-iters {self.decay_steps} must exceed --lr-warmup-iters {self.warmup_steps}"
            )

    def __call__(self, step: int) -> float:
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * step / self.warmup_steps
        if self.style == "constant":
            return self.max_lr
        if step > self.decay_steps:
            return self.min_lr
        span = self.decay_steps - self.warmup_steps
        if self.style == "WSD":
            anneal = self.wsd_decay_steps or max(1, span // 10)
            stable_until = self.decay_steps - anneal
            if step <= stable_until:
                return self.max_lr
            ratio = (step - stable_until) / anneal
            coeff = {
                "linear": 1.0 - ratio,
                "cosine": 0.5 * (math.cos(math.pi * ratio) + 1.0),
                "exponential": (2.0 * (0.5 ** ratio)) - 1.0,
                "minus_sqrt": 1.0 - math.sqrt(ratio),
            }[self.wsd_style]
        else:
            ratio = (step - self.warmup_steps) / span
            coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)


@dataclass
class WeightDecaySchedule:
    """weight_decay(step) for step = 1, 2, ...: constant, or from `start` to `end` over
    `increment_steps` (Megatron's --weight-decay-incr-style linear or cosine), `end` after."""

    start: float
    end: float
    increment_steps: float
    style: str = "constant"

    def __call__(self, step: int) -> float:
        if self.style == "constant" or step > self.increment_steps:
            return self.end
        ratio = step / self.increment_steps
        coeff = ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start + coeff * (self.end - self.start)
