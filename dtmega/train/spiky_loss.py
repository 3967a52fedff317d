"""`--check-for-spiky-loss`: Megatron's rule for a loss spike (the loss above 10x the largest of
the recent losses), told apart from a transient fault by re-running the step.

A spike is either in the data and the model (a bad batch, an unstable layer: the same batch on
the same weights gives it again) or a fault of the machine (a flipped bit in a GPU's memory or
a link: a re-run does not give it again). The step's forward and backward are re-run once on
the same batch, from the same random state, before the optimizer touches the weights:
- reproduced: reported as coming from the data or the model; the step goes on with it (the
  non-finite check and gradient clipping still apply);
- not reproduced: reported loudly as a transient fault, naming the step and both losses; the
  step goes on with the re-run's loss and gradients, so the fault leaves no trace in the weights.

The check reads the loss on the host before the optimizer step: one device synchronization per
step, which is why it is off by default (as in Megatron).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

SPIKE_FACTOR = 10.0  # Megatron's threshold: 10x the recent maximum
WINDOW = 50  # recent accepted steps the maximum is taken over
MIN_HISTORY = 5  # steps seen before the check starts (the first losses have no baseline)
SAME_LOSS = 1e-3  # relative: a re-run on the same batch and state that differs by more is another result


@dataclass
class Spike:
    """One spiky step: its loss, the re-run's, and the recent maximum it was compared with."""

    step: int
    loss: float
    rerun: float
    recent_max: float

    @property
    def reproduced(self) -> bool:
        return math.isclose(self.loss, self.rerun, rel_tol=SAME_LOSS)

    def describe(self) -> str:
        head = (f"spiky loss at step {self.step}: {self.loss:.4g}, over {SPIKE_FACTOR:g}x the recent maximum "
                f"{self.recent_max:.4g}; re-run on the same batch: {self.rerun:.4g}")
        if self.reproduced:
            return f"{head}: reproduced, so it comes from the data or the model, not from a fault; training goes on"
        return (f"{head}: NOT reproduced, a transient fault of this machine (memory, link or device); the step goes on "
                "with the re-run's result. Repeated faults: check the hardware of this job's nodes")


class SpikyLossCheck:
    """Tracks the recent losses and says which losses are spikes; collects the spikes found."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.spikes: list[Spike] = []

    def is_spike(self, loss: float) -> bool:
        """Whether a finite `loss` is above SPIKE_FACTOR x the recent maximum (non-finite losses
        are the divergence check's)."""
        return len(self.recent) >= MIN_HISTORY and math.isfinite(loss) and loss > SPIKE_FACTOR * max(self.recent)

    def accept(self, loss: float) -> None:
        """The loss the step went on with becomes history (a non-finite one does not)."""
        if math.isfinite(loss):
            self.recent.append(loss)

    def record(self, step: int, loss: float, rerun: float) -> Spike:
        """Records a spike and its re-run; returns it (`describe()` is what the console says)."""
        spike = Spike(step, loss, rerun, max(self.recent))
        self.spikes.append(spike)
        return spike


def random_state() -> tuple:
    """This process's CPU and CUDA random states, to re-run a step from where it began."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [])


def set_random_state(state: tuple) -> None:
    """Restores `random_state()`'s result."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
