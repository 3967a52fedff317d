"""All-gather attention: every rank gathers all key/value shards and attends its own queries;
the backward reduce-scatters dK/dV home.

The gather runs while the rank attends its own block, and the gathered blocks are walked like
the ring's (hidden blocks skipped, no mask but the own block's causal one, fused block kernel),
so it costs the memory of the whole sequence's keys and values, and no more.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtmega.kernels.attention_blocks import attend, attend_backward, visible_block
from dtmega.kernels.context_shards import token_indices
from dtmega.kernels.precision import accumulation_dtype


def _blocks(kv: torch.Tensor, gathered: torch.Tensor, pending, positions, rank: int, causal: bool):
    """This rank's own block first (while the gather is in flight), then everyone else's."""
    mine = positions[rank]
    yield kv, visible_block(mine, mine, causal)
    if pending is not None:
        pending.wait()
    for owner, theirs in enumerate(positions):
        if owner != rank:
            yield gathered[owner], visible_block(mine, theirs, causal)


class AllGatherAttention(torch.autograd.Function):
    """q [B, H, S/cp, D], k/v [B, Hkv, S/cp, D] (this rank's shard) -> its shard of the output."""

    @staticmethod
    def forward(ctx, q, k, v, seq_len, group, zigzag, causal, scale, stats, fused):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        positions = [token_indices(seq_len, world, r, zigzag, q.device) for r in range(world)]
        kv = torch.stack([k, v]).contiguous()
        gathered = torch.empty((world * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
        pending = dist.all_gather_into_tensor(gathered, kv, group=group, async_op=True)
        gathered = gathered.view(world, *kv.shape)
        if stats is not None:
            stats.add(kv, world - 1)
        out, lse = attend(q, _blocks(kv, gathered, pending, positions, rank, causal), scale, fused)
        ctx.save_for_backward(q, gathered, out, lse)
        ctx.meta = (positions, rank, group, causal, scale, stats, fused)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, gathered, out, lse = ctx.saved_tensors
        positions, rank, group, causal, scale, stats, fused = ctx.meta
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=accumulation_dtype(q.dtype), device=q.device)
        dgathered = torch.zeros(gathered.shape, dtype=accumulation_dtype(q.dtype), device=q.device)
        for owner, theirs in enumerate(positions):
            visible = visible_block(positions[rank], theirs, causal)
            if visible is not None:
                dk, dv, col = attend_backward(grad_out, q, out, lse, gathered[owner], visible, scale, fused, dq)
                dgathered[owner, 0, :, :, :col] += dk
                dgathered[owner, 1, :, :, :col] += dv
        dkv = torch.empty(gathered.shape[1:], dtype=accumulation_dtype(q.dtype), device=q.device)
        dist.reduce_scatter_tensor(dkv, dgathered.flatten(0, 1), group=group)
        if stats is not None:
            stats.add(dkv, len(positions) - 1)
        dtype = gathered.dtype
        return dq.to(q.dtype), dkv[0].to(dtype), dkv[1].to(dtype), None, None, None, None, None, None, None
