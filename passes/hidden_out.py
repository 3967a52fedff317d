"""The output layer of a plan whose loss is fused: logits when called, hidden states for the loss.

A fused linear cross entropy takes the hidden states and the output layer's weight, so while the
loss runs the output layer must hand its input through. Everywhere else (`pm(tokens)`,
generation, serving, evaluation) it must stay the output layer. `returns_hidden(modules)` is the
switch, held only around the loss's forward; outside it the layer computes logits exactly as
in a plan without the fused loss (vocab-sharded under tensor parallelism).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

HIDDEN_OUT = "_dtmega_hidden_out"


def install_hidden_out(module: nn.Module) -> None:
    """Makes `module` (an output layer) return its input while `returns_hidden` holds it."""
    forward = module.forward

    def forward_or_hidden(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden if getattr(module, HIDDEN_OUT) else forward(hidden, *args, **kwargs)

    setattr(module, HIDDEN_OUT, False)
    module.forward = forward_or_hidden


@contextlib.contextmanager
def returns_hidden(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Inside, the given output layers return their (gathered) input instead of logits."""
    modules = [m for m in modules if hasattr(m, HIDDEN_OUT)]
    for module in modules:
        setattr(module, HIDDEN_OUT, True)
    try:
        yield
    finally:
        for module in modules:
            setattr(module, HIDDEN_OUT, False)


@contextlib.contextmanager
def returns_logits(module: nn.Module) -> Iterator[None]:
    """Inside, `module` computes logits even while `returns_hidden` holds it: for a model that
    calls its output layer again inside its forward (DeepSeek's multi-token prediction)."""
    held = getattr(module, HIDDEN_OUT, None)
    if held:
        setattr(module, HIDDEN_OUT, False)
    try:
        yield
    finally:
        if held:
            setattr(module, HIDDEN_OUT, held)


class OutputOrHiddenParallel(ColwiseParallel):
    """The tensor-parallel output layer of a fused loss: vocab-sharded DTensor logits, as the
    plain output style gives, except while `returns_hidden` holds it, when its input (gathered
    to replicated, as the vocab-parallel fused loss needs) passes through untouched."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if getattr(mod, HIDDEN_OUT, False):
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
