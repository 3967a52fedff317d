"""The run-time half of the contract: what passes and model families add to every training step.

Passes add `RuntimeHook`s in `apply` (`program.add_hook`), the model's family adds those its
own layers need (`ModelFamily.runtime_hooks`), and a pass may set the one `Executor`. Then
`ParallelModel.forward_backward` is one loop for every plan:

    batch = hooks' shard_batch(data-parallel batch)          # CP: this rank's sequence shard
    tokens = sum of loss tokens over the data (x context) ranks
    hooks' begin_step(step)                                   # MoE: scale of the balancing losses
    loss_sum = executor.run(batch, micro-batches, step)       # micro-batch loop, or a pipeline schedule
    loss = all ranks' loss_sum / tokens + hooks' extra_loss   # MoE: the balancing losses
    ... optimizer.step(); pm.after_optimizer_step()           # MoE expert bias; FP8 scale updates

A hook overrides only what it needs; every method has a do-nothing default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from dtmega.passes.errors import PlanError


@dataclass
class Batch:
    """The unpacked, validated fields of a batch: [B, S] tensors, one per token.

    `extra` holds the per-token fields a plan's passes and loss declared beyond the four every
    plan has (`Pass.batch_fields`, `Loss.fields`: document ids, token weights, MTP labels, ...).
    Every field is cut by the same rules, here and nowhere else: dim 0 across data-parallel ranks
    (the TensorDict) and micro-batches (`split`), dim 1 across context-parallel ranks (`map`);
    under pipeline parallelism the loss's fields travel to the last stage packed (`loss_target`)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor | None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Batch":
        """The batch with `fn` applied to every per-token tensor (a sharding of dim 0 or 1)."""
        return Batch(fn(self.tokens), fn(self.labels), fn(self.loss_mask),
                     None if self.position_ids is None else fn(self.position_ids),
                     {name: fn(tensor) for name, tensor in self.extra.items()})

    def split(self, microbatches: int) -> list["Batch"]:
        """Splits dim 0 into `microbatches` equal parts (gradient accumulation, pipelining)."""
        size = self.tokens.shape[0]
        if microbatches < 1 or size % microbatches:
            raise PlanError(
                f"a batch of {size} sequences cannot be split into {microbatches} equal micro-batches. "
                f"Fix: make the batch size a multiple of {microbatches}"
            )
        return [self.map(lambda t, i=i: t.chunk(microbatches)[i]) for i in range(microbatches)]

    def loss_target(self) -> tuple[torch.Tensor, tuple[tuple[str, torch.dtype], ...]]:
        """What the loss reads (labels, loss mask, extra fields) as one float64 [B, S, F] tensor,
        and the names and dtypes to unpack it with (`from_loss_target`): how a pipeline hands
        them to the loss on the last stage (its schedule splits one target tensor). float64
        holds every token id and mask exactly."""
        fields = {"labels": self.labels, "loss_mask": self.loss_mask, **self.extra}
        return (torch.stack([t.double() for t in fields.values()], dim=-1),
                tuple((name, t.dtype) for name, t in fields.items()))

    @staticmethod
    def from_loss_target(target: torch.Tensor, layout: tuple[tuple[str, torch.dtype], ...]) -> "Batch":
        """The loss's fields of a micro-batch back from `loss_target` (no tokens: the loss does
        not read them)."""
        fields = {name: target[..., i].to(dtype) for i, (name, dtype) in enumerate(layout)}
        labels, loss_mask = fields.pop("labels"), fields.pop("loss_mask")
        return Batch(labels, labels, loss_mask, None, fields)


AVERAGING = ("tokens", "microbatches")  # StepContext.averaging


@dataclass
class StepContext:
    """What one `forward_backward` call shares with the hooks and the executor."""

    microbatches: int
    loss_scale: float  # fp16 loss scaling: gradients are those of loss_scale x the loss
    ranks: int  # ranks gradients are averaged over (data x context): each scales its loss by it
    grad_scale: torch.Tensor  # per-token gradient scale: ranks x loss_scale / global loss tokens
    train: bool = True
    # How the gradient averages the loss: "tokens", the global batch's token-weighted mean (the
    # unsharded model's loss; Megatron's --calculate-per-token-loss), or "microbatches", each
    # micro-batch's own token mean on each rank, averaged over micro-batches and ranks
    # (Megatron's default). The returned loss is the token-weighted mean either way, as Megatron
    # reports it.
    averaging: str = "tokens"

    def scale_for(self, chunk: "Batch") -> torch.Tensor:
        """The gradient scale of one micro-batch's summed loss on this rank."""
        if self.averaging == "tokens":
            return self.grad_scale
        tokens = chunk.loss_mask.sum().to(torch.float32).clamp(min=1.0)  # all masked: zero, as Megatron
        return self.loss_scale / (tokens * self.microbatches)


class RuntimeHook:
    """Run-time behaviour a pass or a model family adds to every step (no-op defaults)."""

    # A family's hook that must see the batch before the passes' hooks cut it (e.g. it derives
    # per-token fields from whole sequences, which context parallelism then cuts with the rest).
    runs_before_passes = False

    def shard_batch(self, batch: Batch) -> Batch:
        """This rank's part of the data-parallel batch (context parallelism: its sequence shard)."""
        return batch

    def unshard_output(self, output: torch.Tensor) -> torch.Tensor:
        """The inverse of `shard_batch` for a [B, S_local, ...] model output (the logits
        `pm(tokens)` returns): context parallelism gathers every rank's tokens back in order."""
        return output

    def begin_step(self, step: StepContext) -> None:
        """Before the step's forward (e.g. how MoE layers scale their balancing losses)."""

    def extra_loss(self, step: StepContext) -> torch.Tensor | None:
        """A term added to the returned loss, the same on every rank (e.g. MoE balancing losses)."""
        return None

    def gradient_sync(self, enabled: bool) -> None:
        """Whether the next backward reduces gradients (off for all but the last micro-batch)."""

    def after_optimizer_step(self) -> None:
        """After `optimizer.step()` (expert-bias updates; FP8 scale and amax-history updates)."""

    def stats(self) -> dict[str, Any]:
        """Statistics for logging since the last call (collective: call on every rank)."""
        return {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """State that belongs in a checkpoint (e.g. FP8 amax histories), keys unique per hook."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores what `state_dict` returned (every key it names is present)."""


# loss_fn(module, batch, grad_scale) -> the batch's summed loss over loss tokens; with a
# grad_scale it also runs backward of grad_scale x that sum (inside whatever context the loss
# needs for its backward, e.g. vocab-parallel cross entropy's).
LossFn = Callable[[nn.Module, Batch, "torch.Tensor | None"], torch.Tensor]


class Executor:
    """How a step's forward and backward run over this rank's batch."""

    group = None  # the process group the executor sums losses over (pipelines), if any

    def default_microbatches(self) -> int:
        """Micro-batches per step when the caller gives none."""
        return 1

    def run(self, batch: Batch, step: StepContext, hooks: list[RuntimeHook]) -> torch.Tensor:
        """Forward (and backward if `step.train`) over `step.microbatches` parts of `batch`;
        returns this rank's summed, unscaled loss over loss tokens (detached)."""
        raise NotImplementedError


class MicrobatchLoop(Executor):
    """Gradient accumulation: each micro-batch's forward and backward in turn, gradients
    reduced only after the last one."""

    def __init__(self, module: nn.Module, loss_fn: LossFn):
        self.module, self.loss_fn = module, loss_fn

    def run(self, batch: Batch, step: StepContext, hooks: list[RuntimeHook]) -> torch.Tensor:
        total = torch.zeros((), device=batch.tokens.device)
        chunks = batch.split(step.microbatches)
        for index, chunk in enumerate(chunks):
            if step.train:
                for hook in hooks:
                    hook.gradient_sync(index == len(chunks) - 1)
                loss = self.loss_fn(self.module, chunk, step.scale_for(chunk))
            else:
                with torch.no_grad():
                    loss = self.loss_fn(self.module, chunk, None)
            total = total + loss.detach()
        return total
