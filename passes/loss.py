"""The training loss a plan computes: token-level cross entropy, summed over loss tokens.

The default runs the model to logits (vocab-sharded DTensor logits under tensor parallelism)
and the per-token cross entropy of `dtmega.kernels` (loss-parallel when sharded). A plan that
fuses the output layer with the loss (`FuseKernels`) swaps in the fused kernel through
`loss_for(program)`, which reads the output module's kernel from the layout.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dtmega.kernels import cross_entropy_context, per_token_cross_entropy
from dtmega.passes.families import default_logits
from dtmega.passes.runtime import Batch, LossFn

# kernel name on the output module -> a builder of its loss function from the program
LOSSES: dict[str, Callable[..., LossFn]] = {}


def register_loss(kernel: str, build: Callable[..., LossFn]) -> None:
    """Makes `kernel` (a name a pass may write on the output module) compute the loss."""
    LOSSES[kernel] = build


def logits_cross_entropy(logits_fn) -> LossFn:
    """Loss from the model's logits: per-token cross entropy (vocab-parallel when sharded)."""

    def loss(module: nn.Module, batch: Batch, grad_scale: torch.Tensor | None) -> torch.Tensor:
        logits = logits_fn(module, batch.tokens, batch.position_ids)
        with cross_entropy_context(logits):
            total = (per_token_cross_entropy(logits, batch.labels) * batch.loss_mask).sum()
            if grad_scale is not None:
                (total * grad_scale).backward()
        return total

    return loss


def loss_for(program) -> LossFn:
    """The plan's loss: the output module's kernel picks it; logits + cross entropy otherwise."""
    family = program.family
    logits_fn = family.logits if family is not None else default_logits
    if family is not None and program.facts.output in program.layout:
        kernel = program.layout[program.facts.output].kernel
        if kernel in LOSSES:
            return LOSSES[kernel](program)
    return logits_cross_entropy(logits_fn)
