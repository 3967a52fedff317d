"""Divergence stops a run: Megatron's `--check-for-nan-in-loss-and-grad`, with a bounded streak.

Every step whose loss or global gradient norm is not finite is skipped (the optimizer does not
step: see `Trainer.step`) and said on the console. One such step is survivable (a bad batch,
a transient fault), and large runs skip a few; a streak of `--max-skipped-steps` of them in a
row is divergence, and the run stops with `TrainingDiverged` (exit code 2) naming the steps
and the last checkpoint, which was written before the streak began: no checkpoint is written
while a streak is under way.

Why 10 by default: a diverged model stays non-finite on every batch, so ten in a row costs ten
steps of compute; a transient fault (one corrupt batch, one flipped bit) is one or two steps,
and ten consecutive bad batches are a data problem worth stopping for as well.

A run can also die without a NaN: weights so large that every logit saturates (`--init-method-std
1e30`) give a finite loss of exactly ln(vocabulary) and a gradient norm of exactly 0 at every step;
before, such a run saved ten checkpoints of a dead model and exited 0. A step whose gradient norm
is 0, or whose loss equals ln(vocabulary) to 1e-5 (uniform predictions: an untrained model's
loss differs from it by far more from batch to batch), is *dead*; `--max-skipped-steps` dead
steps in a row stop the run the same way, and no checkpoint is written while such a streak is
under way, so the message never recommends a checkpoint of a dead model.

fp16's dynamic loss scaling skips steps whose *gradients* overflow as a matter of course (the
scale is searching downwards); those are not counted, only a non-finite loss is.

The decision reads values that are identical on every rank (the loss and the norm are reduced
over the whole job), so every rank stops at the same step. To keep the GPU busy, step N's
values are read after step N+1 has been queued (one step later), except where a checkpoint is
due or the run ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dtmega.kernels.errors import DtmegaError


class TrainingDiverged(DtmegaError):
    """A streak of non-finite steps reached --max-skipped-steps."""


@dataclass
class StepHealth:
    """Non-finite steps seen so far and the current streak."""

    max_streak: int
    loss_only: bool = False  # fp16: gradient overflows are loss scaling's, only the loss counts
    console: object = None
    last_checkpoint: str | None = None
    ln_vocab: float | None = None  # ln of the model's (padded) vocabulary: the loss of uniform predictions
    streak: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    skipped: int = 0
    _pending: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def record(self, step: int, loss: torch.Tensor, norm: torch.Tensor) -> None:
        """Remembers step `step`'s device values; checks every earlier step (no wait on this one)."""
        self._pending.append((step, loss, norm))
        self._settle(keep=1)

    def settle(self) -> None:
        """Checks every recorded step (waits for the device): before a checkpoint."""
        self._settle(keep=0)

    def finish(self) -> None:
        """At the end of the run: a run that ends inside a streak did not train to the end
        (its last checkpoint was not written) and stops as diverged too."""
        self.settle()
        if self.dead:
            raise TrainingDiverged(self._dead_message("training ended"))
        if self.streak:
            raise TrainingDiverged(
                f"training ended in {len(self.streak)} non-finite steps in a row (steps {self.streak[0]}-"
                f"{self.streak[-1]}), so its final checkpoint was not saved; {self._last()}. Fix: resume from the "
                "last checkpoint with a lower --lr, and check the data at those steps"
            )

    def _last(self) -> str:
        return (f"the last checkpoint, {self.last_checkpoint}, was saved before the streak began"
                if self.last_checkpoint else "no checkpoint was saved")

    def may_save(self) -> bool:
        """Whether a checkpoint may be written now: not while a streak is under way."""
        self.settle()
        return not self.streak and not self.dead

    def _settle(self, keep: int) -> None:
        while len(self._pending) > keep:
            step, loss, norm = self._pending.pop(0)
            loss_finite = bool(torch.isfinite(loss))
            finite = loss_finite if self.loss_only else loss_finite and bool(torch.isfinite(norm))
            if finite:
                self.streak.clear()
                self._check_alive(step, float(loss), float(norm))
                continue
            self.skipped += 1
            self.streak.append(step)
            if self.console is not None:
                self.console.print(
                    f"[bold yellow]step {step}: loss {float(loss):.4g}, gradient norm {float(norm):.4g}: not finite, "
                    f"step skipped[/bold yellow] ({len(self.streak)} in a row; the run stops at {self.max_streak})"
                )
            if len(self.streak) >= self.max_streak:
                raise TrainingDiverged(
                    f"training diverged: the loss or gradient norm was not finite at steps {self.streak[0]}-{step} "
                    f"({len(self.streak)} in a row, --max-skipped-steps {self.max_streak}); {self._last()}. Fix: resume from "
                    "the last checkpoint with a lower --lr (or more --lr-warmup-iters, or --clip-grad), and check "
                    "the data at those steps"
                )

    def _check_alive(self, step: int, loss: float, norm: float) -> None:
        at_uniform = self.ln_vocab is not None and abs(loss - self.ln_vocab) <= 1e-5 * self.ln_vocab
        if norm != 0.0 and not at_uniform:
            self.dead.clear()
            return
        self.dead.append(step)
        if self.console is not None and len(self.dead) == 1:
            self.console.print(f"[bold yellow]step {step}: loss {loss:.6g}, gradient norm {norm:.4g}: the model is not "
                               f"learning (no checkpoint until this ends; the run stops after {self.max_streak} such "
                               "steps in a row)[/bold yellow]")
        if len(self.dead) >= self.max_streak:
            raise TrainingDiverged(self._dead_message("training is dead"))

    def _dead_message(self, what: str) -> str:
        why = "a gradient norm of exactly 0"
        if self.ln_vocab is not None:
            why = f"a loss of ln(vocabulary) = {self.ln_vocab:.4f} (the loss of uniform predictions), or {why}"
        then = "resume from that checkpoint" if self.last_checkpoint else "start again"
        return (f"{what}: steps {self.dead[0]}-{self.dead[-1]} ({len(self.dead)} in a row) had {why}: the model does "
                f"not learn; {self._last()}. Fix: check --init-method-std (Megatron's default is 0.02), --lr and the "
                f"data, then {then}")
