"""Per-token cross entropy, on plain logits or on vocab-sharded (tensor-parallel) logits.

Vocab-sharded logits never get gathered: under tensor parallelism the max, the log-sum-exp and
the target logit are reduced across the vocab shards (torch's `loss_parallel`), so peak memory
stays at [tokens, vocab / tp].
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from dtmega.kernels.precision import accumulation_dtype


def is_vocab_sharded(logits: torch.Tensor) -> bool:
    """True if `logits` is a DTensor sharded along its last (vocab) dim."""
    if not isinstance(logits, DTensor):
        return False
    last = logits.ndim - 1
    return any(isinstance(p, Shard) and p.dim in (-1, last) for p in logits.placements)


def _loss_parallel_active() -> bool:
    """Whether an enclosing `loss_parallel()` holds already. torch's context does not nest: its
    exit removes the vocab-parallel handlers even when an outer one still needs them (a model
    computing a loss of its own inside a pipeline step that holds the context throughout)."""
    try:
        from torch.distributed.tensor.parallel.loss import customized_loss_ops
    except ImportError:  # another layout of torch's internals: enter anyway
        return False
    handlers = DTensor._op_dispatcher._custom_op_handlers
    return all(op in handlers for op in customized_loss_ops)


@contextlib.contextmanager
def vocab_parallel_context(needed: bool = True) -> Iterator[None]:
    """torch's `loss_parallel()` unless one holds already (or not `needed`): around a whole step
    whose model computes vocab-parallel losses of its own, so that their backward, run with the
    plan's (maybe fused, maybe unsharded) loss's, finds it."""
    with loss_parallel() if needed and not _loss_parallel_active() else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def cross_entropy_context(logits: torch.Tensor) -> Iterator[None]:
    """The context both the loss forward and its backward must run in (vocab-parallel needs it);
    inside one that holds already, nothing more."""
    needed = is_vocab_sharded(logits) and not _loss_parallel_active()
    with loss_parallel() if needed else contextlib.nullcontext():
        yield


def per_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)[label] for every token, fp32 (float64 for float64 logits), as a
    plain [B, S] tensor.

    Call inside `cross_entropy_context(logits)`.
    """
    batch, seq = labels.shape
    losses = F.cross_entropy(logits.to(accumulation_dtype(logits.dtype)).flatten(0, 1), labels.flatten(),
                             reduction="none")
    if isinstance(losses, DTensor):
        losses = losses.to_local()
    return losses.view(batch, seq)
