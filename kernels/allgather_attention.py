"""All-gather attention: every rank gathers all key/value shards and attends its own queries;
the backward reduce-scatters dK/dV home.

The gather runs while the rank attends its own block, and the gathered blocks are walked like
the ring's (hidden blocks skipped, no mask but the own block's causal one, fused block kernel),
so it costs the memory of the whole sequence's keys and values, and no more.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtmega.kernels.attention_blocks import attend, attend_backward
from dtmega.kernels.context_blocks import ContextBlocks
from dtmega.kernels.precision import accumulation_dtype


def _blocks(kv: torch.Tensor, gathered: torch.Tensor, pending, blocks: ContextBlocks, rank: int):
    """This rank's own block first (while the gather is in flight), then everyone else's."""
    yield kv, blocks.parts(rank, rank)
    if pending is not None:
        pending.wait()
    for owner in range(blocks.world):
        if owner != rank:
            yield gathered[owner], blocks.parts(rank, owner)


class AllGatherAttention(torch.autograd.Function):
    """q [B, H, S/cp, D], k/v [B, Hkv, S/cp, D] (this rank's shard) -> its shard of the output;
    `blocks` says which parts of each rank's keys this rank's queries see."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, group, scale, stats, fused):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        kv = torch.stack([k, v]).contiguous()
        gathered = torch.empty((world * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
        pending = dist.all_gather_into_tensor(gathered, kv, group=group, async_op=True)
        gathered = gathered.view(world, *kv.shape)
        if stats is not None:
            stats.add(kv, world - 1)
        out, lse = attend(q, _blocks(kv, gathered, pending, blocks, rank), scale, fused, stats)
        ctx.save_for_backward(q, gathered, out, lse)
        ctx.meta = (blocks, rank, group, scale, stats, fused)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, gathered, out, lse = ctx.saved_tensors
        blocks, rank, group, scale, stats, fused = ctx.meta
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=accumulation_dtype(q.dtype), device=q.device)
        dgathered = torch.zeros(gathered.shape, dtype=accumulation_dtype(q.dtype), device=q.device)
        for owner in range(blocks.world):
            attend_backward(grad_out, q, out, lse, gathered[owner], blocks.parts(rank, owner), scale, fused, dq,
                            dgathered[owner])
        dkv = torch.empty(gathered.shape[1:], dtype=accumulation_dtype(q.dtype), device=q.device)
        dist.reduce_scatter_tensor(dkv, dgathered.flatten(0, 1), group=group)
        if stats is not None:
            stats.add(dkv, blocks.world - 1)
        dtype = gathered.dtype
        return dq.to(q.dtype), dkv[0].to(dtype), dkv[1].to(dtype), None, None, None, None, None
