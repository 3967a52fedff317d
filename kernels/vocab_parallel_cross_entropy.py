"""Vocab-parallel fused linear cross entropy: the weight a DTensor Shard(0) on a 1-D tensor-
parallel mesh, the hidden states replicated on it; loss_parallel's numerics on local shards."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dtmega.kernels.linear_cross_entropy_core import (
    _backward,
    _check,
    _forward,
    _Options,
    default_chunk_size,
)

# ---------------------------------------------------------------------------------------------
# Vocab parallel: weight a DTensor Shard(0) on a 1-D mesh, hidden replicated on it.


def _options(weight: torch.Tensor, ignore_index: int, chunk_size: int | None, z_loss: float, impl: str) -> _Options:
    local_vocab = weight.to_local().shape[0] if isinstance(weight, DTensor) else weight.shape[0]
    return _Options(ignore_index, chunk_size or default_chunk_size(local_vocab), float(z_loss), impl)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A replicated input's local value (plain tensors are taken as replicated)."""
    if isinstance(t, DTensor):
        if not all(isinstance(p, Replicate) for p in t.placements):
            raise ValueError(f"expected a replicated DTensor, got placements {t.placements}")
        return t.to_local()
    return t


def _vocab_shard(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's weight rows and the global index of its first (DTensor's torch.chunk split)."""
    if not isinstance(weight, DTensor):
        raise ValueError("hidden is a DTensor but weight is not: expected weight vocab-sharded (Shard(0))")
    mesh = weight.device_mesh
    if mesh.ndim != 1 or not isinstance(weight.placements[0], Shard) or weight.placements[0].dim != 0:
        raise NotImplementedError(
            f"fused linear cross entropy takes a weight sharded Shard(0) on a 1-D mesh, got {weight.placements} "
            f"on a {mesh.ndim}-D mesh")
    vocab, size, rank = weight.shape[0], mesh.size(), mesh.get_local_rank()
    per_rank = -(-vocab // size)
    start = min(rank * per_rank, vocab)
    local = weight.to_local()
    if local.shape[0] != min(per_rank, vocab - start):
        raise NotImplementedError(f"unexpected local vocab shard {tuple(local.shape)} of {tuple(weight.shape)}")
    return local, start


class _VocabParallel(torch.autograd.Function):
    """Vocab-parallel per-token losses (token_weights None) or weighted sum, on local shards."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, token_weights, opts: _Options):
        w, vocab_start = _vocab_shard(weight)
        h, lab = _local(hidden), _local(labels)
        _check(h, w, lab)
        mesh = weight.device_mesh
        if isinstance(hidden, DTensor) and hidden.device_mesh != mesh:
            raise ValueError("hidden and weight must live on the same mesh")
        ctx.mesh, ctx.opts, ctx.vocab_start = mesh, opts, vocab_start
        ctx.hidden_is_dtensor = isinstance(hidden, DTensor)
        ctx.weight_meta = (weight.placements, weight.shape, weight.stride())
        ctx.hidden_meta = (hidden.shape, hidden.stride())
        ctx.summed = token_weights is not None
        group = mesh.get_group()
        if ctx.summed:
            scale = _local(token_weights).float()
            compute_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
            loss, _, grad_h, grad_w = _forward(h, w, lab, scale, opts, compute_grad, group, vocab_start)
            if compute_grad:
                ctx.save_for_backward(grad_h, grad_w)
            return (loss * scale).sum()
        loss, lse, _, _ = _forward(h, w, lab, None, opts, False, group, vocab_start)
        ctx.save_for_backward(h, w, lab, lse)
        return loss

    @staticmethod
    def backward(ctx, grad):
        if ctx.summed:
            grad_h, grad_w = ctx.saved_tensors
            grad_h, grad_w = grad_h * grad, grad_w * grad
        else:
            h, w, lab, lse = ctx.saved_tensors
            grad_h, grad_w = _backward(grad, h, w, lab, lse, ctx.opts, ctx.vocab_start)
        placements, shape, stride = ctx.weight_meta
        grad_w = DTensor.from_local(grad_w, ctx.mesh, placements, shape=shape, stride=stride, run_check=False)
        if ctx.hidden_is_dtensor:  # a partial sum over this rank's vocab: reduced by whoever consumes it
            shape, stride = ctx.hidden_meta
            grad_h = DTensor.from_local(grad_h, ctx.mesh, [Partial()], shape=shape, stride=stride, run_check=False)
        else:
            dist.all_reduce(grad_h, group=ctx.mesh.get_group())
        return grad_h, grad_w, None, None, None
