"""Context-parallel attention: each rank holds a slice of the sequence (queries, keys, values)
and attention still sees the whole sequence.

- ring: key/value blocks travel around the ring (point-to-point, the next transfer overlapped
  with the current block's compute); partial results merge by log-sum-exp; the backward sends the
  blocks around again, each carrying its accumulating dK/dV home.
- all_gather: gather every key/value block, attend the local queries (the backward
  reduce-scatters dK/dV).
- a2a (Ulysses): all-to-all from sequence shards to head shards, full-sequence attention on
  H/cp heads, and back.

Masks are built from the global token index of every query and key, so any sharding of the
sequence (contiguous or zigzag) is exact. Tensors are [B, S, H, D]; keys/values may have fewer
heads (GQA). Plain PyTorch: the same code runs on gloo and nccl.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol

METHODS = ("ring", "all_gather", "a2a")


@dataclass
class CommStats:
    """Bytes this rank sent for context-parallel attention (forward and backward)."""

    bytes_sent: int = 0

    def add(self, tensor: torch.Tensor, copies: int = 1) -> None:
        self.bytes_sent += tensor.numel() * tensor.element_size() * copies


def token_indices(seq_len: int, world: int, rank: int, zigzag: bool, device=None) -> torch.Tensor:
    """Global positions of the `seq_len // world` tokens `rank` holds: a contiguous chunk, or
    with zigzag the chunks `rank` and `2*world-1-rank` of 2*world (equal causal work per rank)."""
    if not zigzag:
        chunk = seq_len // world
        return torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    chunk = seq_len // (2 * world)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    mirror = 2 * world - 1 - rank
    return torch.cat([first, torch.arange(mirror * chunk, (mirror + 1) * chunk, device=device)])


def _group_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, S, H, D] -> [B, Hkv, G, S, D] so each key/value head serves its G query heads."""
    b, s, h, d = q.shape
    return q.view(b, s, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)


def _kv_heads(t: torch.Tensor) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, Hkv, 1, S, D]."""
    return t.permute(0, 2, 1, 3).unsqueeze(2)


def _scores(q, k, q_idx, k_idx, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~(k_idx[None, :] <= q_idx[:, None]), float("-inf"))
    return s


def _block_forward(q, k, v, q_idx, k_idx, causal, scale):
    """Attention of grouped queries against one key/value block: (output, log-sum-exp)."""
    s = _scores(q, k, q_idx, k_idx, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(p, v), lse


def _merge(out, lse, block_out, block_lse):
    """Combine two partial softmax results by their log-sum-exps."""
    new_lse = torch.logaddexp(lse, block_lse)
    old_w = torch.exp(lse - new_lse).nan_to_num(0.0).unsqueeze(-1)
    new_w = torch.exp(block_lse - new_lse).nan_to_num(0.0).unsqueeze(-1)
    return out * old_w + block_out * new_w, new_lse


def _block_backward(q, k, v, dout, delta, lse, q_idx, k_idx, causal, scale):
    """Gradients of one block given the global lse and delta = rowsum(dout * out)."""
    s = _scores(q, k, q_idx, k_idx, causal, scale)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(dim=2, keepdim=True)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(dim=2, keepdim=True) * scale
    return dq, dk, dv


def _count_backward(tensor: torch.Tensor, stats: CommStats | None, world: int) -> None:
    """The backward of an all-gather or all-to-all sends (world-1)/world of the incoming gradient."""
    if stats is not None and tensor.requires_grad:
        def count(grad):
            stats.bytes_sent += grad.numel() * grad.element_size() * (world - 1) // world
        tensor.register_hook(count)


def _exchange(tensor: torch.Tensor, group, send_to: int, recv_from: int, stats: CommStats | None):
    """Starts sending `tensor` to `send_to` and receiving a like tensor from `recv_from`."""
    incoming = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, send_to, group), dist.P2POp(dist.irecv, incoming, recv_from, group)]
    if stats is not None:
        stats.add(tensor)
    return incoming, dist.batch_isend_irecv(ops)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_len, group, zigzag, causal, scale, stats):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        nxt = dist.get_global_rank(group, (rank + 1) % world)
        prv = dist.get_global_rank(group, (rank - 1) % world)
        kv_heads = k.shape[2]
        qg = _group_heads(q.float(), kv_heads)
        q_idx = token_indices(seq_len, world, rank, zigzag, q.device)
        kv = torch.stack([k, v]).contiguous()
        out = lse = None
        for step in range(world):
            pending = _exchange(kv, group, nxt, prv, stats) if step < world - 1 else None
            owner = (rank - step) % world
            k_idx = token_indices(seq_len, world, owner, zigzag, q.device)
            block_out, block_lse = _block_forward(qg, _kv_heads(kv[0].float()), _kv_heads(kv[1].float()),
                                                  q_idx, k_idx, causal, scale)
            out, lse = (block_out, block_lse) if out is None else _merge(out, lse, block_out, block_lse)
            if pending is not None:
                incoming, requests = pending
                for request in requests:
                    request.wait()
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (seq_len, group, zigzag, causal, scale, stats)
        b, s, h, d = q.shape
        return out.permute(0, 3, 1, 2, 4).reshape(b, s, h, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        seq_len, group, zigzag, causal, scale, stats = ctx.meta
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        nxt = dist.get_global_rank(group, (rank + 1) % world)
        prv = dist.get_global_rank(group, (rank - 1) % world)
        kv_heads = k.shape[2]
        qg = _group_heads(q.float(), kv_heads)
        dout = _group_heads(grad_out.float(), kv_heads)
        delta = (dout * out).sum(dim=-1)
        q_idx = token_indices(seq_len, world, rank, zigzag, q.device)
        dq = torch.zeros_like(qg)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(world):
            pending = _exchange(kv, group, nxt, prv, stats) if step < world - 1 else None
            owner = (rank - step) % world
            k_idx = token_indices(seq_len, world, owner, zigzag, q.device)
            dq_block, dk, dv = _block_backward(qg, _kv_heads(kv[0].float()), _kv_heads(kv[1].float()), dout, delta,
                                               lse, q_idx, k_idx, causal, scale)
            dq += dq_block
            dkv[0] += dk.squeeze(2).permute(0, 2, 1, 3)
            dkv[1] += dv.squeeze(2).permute(0, 2, 1, 3)
            # The block's gradient travels on with it; after `world` hops it is home.
            dkv, requests = _exchange(dkv, group, nxt, prv, stats)
            for request in requests:
                request.wait()
            if pending is not None:
                incoming, requests = pending
                for request in requests:
                    request.wait()
                kv = incoming
        b, s, h, d = q.shape
        grad_q = dq.permute(0, 3, 1, 2, 4).reshape(b, s, h, d).to(q.dtype)
        return grad_q, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def _full_attention(q, k, v, q_idx, k_idx, causal, scale):
    """SDPA of local queries against gathered keys with an index-built mask; [B, S, H, D]."""
    mask = (k_idx[None, :] <= q_idx[:, None]) if causal else None
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _all_gather_attention(q, k, v, seq_len, group, zigzag, causal, scale, stats):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if stats is not None:
        stats.add(k, world - 1)
        stats.add(v, world - 1)
    kv = torch.cat([k, v], dim=2)
    gathered = funcol.all_gather_tensor_autograd(kv.contiguous(), gather_dim=1, group=group)
    _count_backward(gathered, stats, world)
    k_all, v_all = gathered.split(k.shape[2], dim=2)
    q_idx = token_indices(seq_len, world, rank, zigzag, q.device)
    k_idx = torch.cat([token_indices(seq_len, world, r, zigzag, q.device) for r in range(world)])
    return _full_attention(q, k_all, v_all, q_idx, k_idx, causal, scale)


def _to_heads(t: torch.Tensor, group, world: int, stats) -> torch.Tensor:
    """[B, S/cp, H, D] sequence shard -> [B, S, H/cp, D] head shard (sequence in rank order)."""
    b, s, h, d = t.shape
    chunks = t.view(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    if stats is not None:
        stats.add(chunks, 1)
        stats.bytes_sent -= chunks.numel() // world * chunks.element_size()  # the own chunk stays
    moved = funcol.all_to_all_single_autograd(chunks.flatten(0, 1), None, None, group)
    _count_backward(moved, stats, world)
    return moved.view(world, b, s, h // world, d).permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)


def _to_sequence(t: torch.Tensor, group, world: int, stats) -> torch.Tensor:
    """Inverse of `_to_heads`."""
    b, full, hh, d = t.shape
    s = full // world
    chunks = t.view(b, world, s, hh, d).permute(1, 0, 2, 3, 4).contiguous()
    if stats is not None:
        stats.add(chunks, 1)
        stats.bytes_sent -= chunks.numel() // world * chunks.element_size()
    moved = funcol.all_to_all_single_autograd(chunks.flatten(0, 1), None, None, group)
    _count_backward(moved, stats, world)
    return moved.view(world, b, s, hh, d).permute(1, 2, 0, 3, 4).reshape(b, s, world * hh, d)


def _a2a_attention(q, k, v, seq_len, group, zigzag, causal, scale, stats):
    world = dist.get_world_size(group)
    h, kvh = q.shape[2], k.shape[2]
    if h % world:
        raise ValueError(f"a2a context parallelism needs attention heads ({h}) divisible by cp ({world})")
    if kvh % world:  # too few key/value heads to split: give each query head its own
        k, v = k.repeat_interleave(h // kvh, dim=2), v.repeat_interleave(h // kvh, dim=2)
    qh, kh, vh = (_to_heads(t, group, world, stats) for t in (q, k, v))
    idx = torch.cat([token_indices(seq_len, world, r, zigzag, q.device) for r in range(world)])
    out = _full_attention(qh, kh, vh, idx, idx, causal, scale)
    return _to_sequence(out, group, world, stats)


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, method: str = "ring", zigzag: bool = True,
    causal: bool = True, scale: float | None = None, stats: CommStats | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale [+ causal mask]) v over the whole sequence, each rank passing its
    shard of q, k, v ([B, S/cp, H, D], GQA allowed) and getting its shard of the output."""
    world = dist.get_world_size(group)
    seq_len = q.shape[1] * world
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if method == "ring":
        return _RingAttention.apply(q, k, v, seq_len, group, zigzag, causal, scale, stats)
    if method == "all_gather":
        return _all_gather_attention(q, k, v, seq_len, group, zigzag, causal, scale, stats)
    if method == "a2a":
        return _a2a_attention(q, k, v, seq_len, group, zigzag, causal, scale, stats)
    raise ValueError(f"context-parallel method {method!r} is unknown; use one of {METHODS}")
