"""Ring attention: key/value blocks travel around the context-parallel ring by point-to-point
transfers (the next hop overlapped with the current block's compute) and partial results merge
by their log-sum-exps; the backward sends the blocks around again, each carrying its
accumulating dK/dV, which arrive home after a full turn.

Blocks no query may see under the mask are skipped: with zigzag shards every block but a
rank's own is half visible and needs no mask, so each rank does the same, halved work; with
packed documents each block is cut into the parts its documents make visible
(kernels/context_blocks.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtmega.kernels.attention_blocks import attend, attend_backward
from dtmega.kernels.context_blocks import ContextBlocks
from dtmega.kernels.context_shards import CommStats
from dtmega.kernels.precision import accumulation_dtype


class _Transfer:
    """A tensor on its way to the next rank of the ring, and a like one arriving from the previous."""

    def __init__(self, tensor: torch.Tensor, group, send_to: int, recv_from: int, stats: CommStats | None):
        self.incoming = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, send_to, group), dist.P2POp(dist.irecv, self.incoming, recv_from, group)]
        if stats is not None:
            stats.add(tensor)
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        """The tensor the previous rank sent."""
        for request in self.requests:
            request.wait()
        return self.incoming


class _Ring:
    """This rank's place in the ring and the parts of every block it computes."""

    def __init__(self, group, blocks: ContextBlocks):
        self.group, self.layout = group, blocks
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.previous = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def send(self, tensor: torch.Tensor, stats: CommStats | None) -> _Transfer:
        """Starts passing `tensor` one hop along the ring."""
        return _Transfer(tensor, self.group, self.next, self.previous, stats)

    def blocks(self, kv: torch.Tensor, stats: CommStats | None):
        """Every rank's key/value block with the parts of it this rank attends, as it arrives:
        the hop of the next block is under way while the caller computes on the current one."""
        for step in range(self.world):
            transfer = self.send(kv, stats) if step < self.world - 1 else None
            owner = (self.rank - step) % self.world
            yield kv, self.layout.parts(self.rank, owner)
            if transfer is not None:
                kv = transfer.wait()


class RingAttention(torch.autograd.Function):
    """q [B, H, S/cp, D], k/v [B, Hkv, S/cp, D] (this rank's shard) -> its shard of the output;
    `blocks` says which parts of each rank's keys this rank's queries see."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, group, scale, stats, fused):
        ring = _Ring(group, blocks)
        out, lse = attend(q, ring.blocks(torch.stack([k, v]).contiguous(), stats), scale, fused, stats)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (blocks, group, scale, stats, fused)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        blocks, group, scale, stats, fused = ctx.meta
        ring = _Ring(group, blocks)
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=accumulation_dtype(q.dtype), device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=accumulation_dtype(kv.dtype), device=kv.device)
        grads = torch.empty_like(dkv)  # this step's share, added once the travelling dK/dV arrive
        dkv_transfer = None
        for block, parts in ring.blocks(kv, stats):
            if parts:
                grads.zero_()
                attend_backward(grad_out, q, out, lse, block, parts, scale, fused, dq, grads)
            # The block's gradient travels with it (arriving while this step computed); after
            # `world` hops it is home.
            if dkv_transfer is not None:
                dkv = dkv_transfer.wait()
            if parts:
                dkv += grads
            dkv_transfer = ring.send(dkv, stats)
        dkv = dkv_transfer.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None
