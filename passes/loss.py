"""The training loss a plan computes, from one source for every executor.

A `Loss` is a criterion over what the model returns: the logits (vocab-sharded DTensor logits
under tensor parallelism), or, for a loss fused with the output layer (`FuseKernels`), the
hidden states the output layer hands it (`hidden_out`, passes/hidden_out.py). The micro-batch
loop runs the model and then the criterion; a pipeline's last stage returns the model output
and its schedule calls the same criterion with the micro-batch's loss fields
(`Batch.loss_target`). So a loss registered here is the loss of every plan.

Which loss a plan uses is a decision in the layout: the kernel a pass writes on the output
module (`register_loss(kernel, build)`); none: per-token cross entropy of the logits. A loss
that reads more of the batch than labels and the loss mask declares those fields (`fields`),
and they are sharded with the batch (passes/runtime.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import nn

from dtmega.kernels import cross_entropy_context, per_token_cross_entropy
from dtmega.kernels.cross_entropy import vocab_parallel_context
from dtmega.passes.families import default_logits
from dtmega.passes.hidden_out import returns_hidden
from dtmega.passes.runtime import Batch, LossFn


@dataclass(frozen=True)
class Loss:
    """A training loss: `criterion(owner, output, batch)` is the summed loss over loss tokens,
    where `owner` is the module holding the output layer (the model, or the last pipeline
    stage) and `output` what the model returned for `batch`."""

    criterion: Callable[[nn.Module, torch.Tensor, Batch], torch.Tensor]
    hidden_out: bool = False  # the model returns the output layer's input (a loss fused with it)
    fields: tuple[str, ...] = ()  # per-token batch fields it reads beyond labels and loss_mask

    def context(self, output: torch.Tensor) -> ContextManager:
        """What the criterion and its backward run under: vocab-parallel cross entropy's
        `loss_parallel` for sharded logits; nothing for a fused loss (it reduces itself)."""
        return contextlib.nullcontext() if self.hidden_out else cross_entropy_context(output)


# kernel name on the output module -> a builder of its loss from the program
LOSSES: dict[str, Callable[..., Loss]] = {}


def register_loss(kernel: str, build: Callable[..., Loss]) -> None:
    """Makes `kernel` (a name a pass may write on the output module) compute the loss:
    `build(program)` returns the `Loss`."""
    LOSSES[kernel] = build


def cross_entropy_sum(owner: nn.Module, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Per-token cross entropy of the logits (vocab-parallel when sharded), summed over loss tokens."""
    return (per_token_cross_entropy(logits, batch.labels) * batch.loss_mask).sum()


CROSS_ENTROPY = Loss(cross_entropy_sum)


def plan_loss(program) -> Loss:
    """The plan's loss: the one registered for the output module's kernel, else cross entropy."""
    family = program.family
    if family is not None and program.facts.output in program.layout:
        kernel = program.layout[program.facts.output].kernel
        if kernel in LOSSES:
            return LOSSES[kernel](program)
    return CROSS_ENTROPY


def document_kwargs(batch: Batch, family, loss_inputs: bool = True) -> dict:
    """`document_ids=...` for a family's logits function when the batch packs documents
    (passes/document_masking.py) and the family's model takes them (a family that masks
    documents by their restarting position ids gets those), and `labels` and `loss_mask` for a
    family whose model computes losses of its own (`ModelFamily.loss_inputs`)."""
    wanted = loss_inputs and family is not None and family.loss_inputs
    extra = {"labels": batch.labels, "loss_mask": batch.loss_mask} if wanted else {}
    if wanted and family.model_inputs is not None:
        extra.update(family.model_inputs(batch))
    documents = batch.extra.get("document_ids")
    if documents is None or family is None or family.document_kwarg is None:
        return extra
    return {**extra, "document_ids": documents}


def loss_for(program) -> LossFn:
    """The micro-batch loop's step of the plan's loss: the model on the batch, the criterion,
    and (training) the backward of `grad_scale` x the summed loss."""
    loss = plan_loss(program)
    family = program.family
    logits_fn = family.logits if family is not None else default_logits
    output_fqn = program.facts.output if family is not None else None
    # a model that computes losses of its own (DeepSeek's multi-token prediction) on vocab-sharded
    # logits needs torch's loss_parallel through its forward and the step's backward, whatever
    # the plan's own loss holds
    own_losses = family is not None and family.loss_inputs and program.layout[output_fqn].style == "output"

    def step(module: nn.Module, batch: Batch, grad_scale: torch.Tensor | None) -> torch.Tensor:
        hidden = [module.get_submodule(output_fqn)] if loss.hidden_out else []
        with vocab_parallel_context(own_losses):
            with returns_hidden(hidden):
                output = logits_fn(module, batch.tokens, batch.position_ids, **document_kwargs(batch, family))
            with loss.context(output):
                total = loss.criterion(module, output, batch)
                if grad_scale is not None:
                    (total * grad_scale).backward()
        return total

    return step
