"""Attention of one block of queries against one block of keys, with the log-sum-exp that
blockwise (ring) attention merges partial results by, and the matching backward.

Layout [B, H, S, D]; keys/values may have fewer heads (GQA). `causal` is the lower-triangular
mask on the block's own indices (query i sees keys 0..i), the only mask ring attention needs
once fully hidden blocks are skipped. On CPU the block runs PyTorch's fused flash-attention
kernel (exact, no [Sq, Sk] score matrix kept); elsewhere the plain-PyTorch reference, which
the tests check the fused path against. Blockwise methods (ring, all-gather) walk the blocks
of keys, each with its parts (kernels/context_blocks.py), and fold each result in with
`merge_partial`.
"""

from __future__ import annotations

import torch

from dtmega.kernels.precision import accumulation_dtype


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, Hkv, G, S, D]: each key/value head with the G query heads it serves."""
    b, h, s, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, s, d)


def _probabilities(q, k, lse, causal: bool, scale: float) -> torch.Tensor:
    """softmax rows of q k^T (fp32, grouped), given their log-sum-exp."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.exp(scores - lse.unsqueeze(-1))


def reference_block_attention(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Sq, D] in q's dtype, lse [B, H, Sq] fp32 or float64), computed in fp32
    matmuls (float64 for float64 inputs)."""
    kv_heads = k.shape[1]
    accumulate = accumulation_dtype(q.dtype)
    qg = _grouped(q.to(accumulate), kv_heads)
    kg, vg = k.to(accumulate).unsqueeze(2), v.to(accumulate).unsqueeze(2)
    scores = torch.matmul(qg, kg.transpose(-1, -2)) * scale
    if causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), vg)
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def reference_block_attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of one block, given the *whole* attention's out and lse (so the block's
    share of the softmax is exact); in the inputs' dtypes."""
    kv_heads = k.shape[1]
    accumulate = accumulation_dtype(q.dtype)
    qg, dog, og = (_grouped(t.to(accumulate), kv_heads) for t in (q, dout, out))
    kg, vg = k.to(accumulate).unsqueeze(2), v.to(accumulate).unsqueeze(2)
    p = _probabilities(qg, kg, _grouped(lse.unsqueeze(-1), kv_heads).squeeze(-1), causal, scale)
    delta = (dog * og).sum(dim=-1, keepdim=True)
    dv = torch.matmul(p.transpose(-1, -2), dog).sum(dim=2)
    ds = p * (torch.matmul(dog, vg.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, kg) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(dim=2) * scale
    return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _fused(device: torch.device) -> bool:
    return device.type == "cpu"


def block_attention(q, k, v, causal: bool, scale: float, fused: bool | None = None):
    """(out, lse) of queries `q` against one key/value block; `fused=None` picks the fused
    kernel where one exists for the device."""
    if _fused(q.device) if fused is None else fused:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.to(accumulation_dtype(q.dtype))
    return reference_block_attention(q, k, v, causal, scale)


def block_attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float, fused: bool | None = None):
    """(dq, dk, dv) of one block given the whole attention's `out` and `lse`."""
    if _fused(q.device) if fused is None else fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    return reference_block_attention_backward(dout, q, k, v, out, lse, causal, scale)


def visible_block(q_idx: torch.Tensor, k_idx: torch.Tensor, causal: bool) -> tuple[int, int, bool] | None:
    """The part of a (queries x keys) block the mask lets anyone see, as (first query row, end
    of the key columns, causal-within-the-part), or None when no query sees any key.

    Both position lists ascend, so the rows that see something are a suffix and the keys seen a
    prefix. The part needs a mask only on a rank's own block, where it is the plain causal one.
    """
    if not causal:
        return 0, len(k_idx), False
    first_row = int(torch.searchsorted(q_idx, k_idx[0]))
    end_col = int(torch.searchsorted(k_idx, q_idx[-1], right=True))
    if first_row == len(q_idx) or end_col == 0:
        return None
    masked = bool(q_idx[first_row] < k_idx[end_col - 1])
    if masked and not torch.equal(q_idx[first_row:], k_idx[:end_col]):
        raise NotImplementedError("ring attention needs zigzag or contiguous shards (a partial mask otherwise)")
    return first_row, end_col, masked


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Folds a block's partial softmax result into the running one, in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).nan_to_num(0.0).unsqueeze(-1))
    out.add_(block_out.to(out.dtype) * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def attend(q: torch.Tensor, blocks, scale: float, fused: bool | None = None, stats=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q` over key/value blocks, given as (stacked [2, B, Hkv, S, D] block, its
    parts: kernels/context_blocks.BlockPart, none = skipped) pairs in any order: (out in q's
    dtype, lse fp32, or float64 for float64 q). `stats` counts blocks attended and skipped."""
    accumulate = accumulation_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=accumulate, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=accumulate, device=q.device)
    for kv, parts in blocks:
        if stats is not None:
            stats.count_block(parts)
        for part in parts:
            b, rows, cols = part.batch, part.rows, part.cols
            block_out, block_lse = block_attention(q[b, :, rows], kv[0, b, :, cols], kv[1, b, :, cols], part.causal,
                                                   scale, fused)
            merge_partial(out[b, :, rows], lse[b, :, rows], block_out, block_lse)
    return out.to(q.dtype), lse


def attend_backward(grad_out, q, out, lse, kv, parts, scale: float, fused: bool | None, dq: torch.Tensor,
                    dkv: torch.Tensor) -> None:
    """One block's share of the backward of `attend`: adds its dQ into `dq` and the block's
    dK, dV into `dkv` ([2, B, Hkv, S, D], fp32 accumulators)."""
    for part in parts:
        b, rows, cols = part.batch, part.rows, part.cols
        dq_block, dk, dv = block_attention_backward(
            grad_out[b, :, rows], q[b, :, rows], kv[0, b, :, cols], kv[1, b, :, cols], out[b, :, rows],
            lse[b, :, rows], part.causal, scale, fused,
        )
        dq[b, :, rows] += dq_block
        dkv[0, b, :, cols] += dk
        dkv[1, b, :, cols] += dv
