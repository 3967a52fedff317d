"""Attention whose backward recomputes it: Megatron's selective activation recompute as an op.

`recomputed_attention(q, k, v)` runs causal (or full) softmax attention and keeps only q, k and
v for backward; the backward recomputes the attention (its output and log-sum-exp, with a fused
kernel) and then its gradients. Nothing of size [S, S] and not even the output is saved, which
is the point of recomputing the attention core. Being one opaque custom op, it behaves the
same eagerly and inside a compiled block (any backend, with or without tensor parallelism):
torch 2.13's activation-checkpoint regions broke there (see passes/recompute.py).

Layout [B, H, S, D]; keys and values may have fewer heads (GQA, H a multiple of theirs).
Kernels: on CPU PyTorch's fused flash kernel forward and backward; on CUDA in bf16/fp16 the
flash-attention kernels (keys/values expanded to H heads for them); elsewhere (e.g. CUDA fp32)
the plain-PyTorch reference of `attention_blocks`, which materializes one [S, S] block per head
group during backward only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtmega.kernels.attention_blocks import (
    block_attention,
    block_attention_backward,
    reference_block_attention,
    reference_block_attention_backward,
)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else q.shape[-1] ** -0.5


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)


@torch.library.custom_op("dtmega::recomputed_attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.contiguous()  # the fake kernel promises contiguous results (compiled graphs check strides)


@_attention.register_fake
def _(q, k, v, causal, scale):
    return q.new_empty(*q.shape[:-1], v.shape[-1]).contiguous()


@torch.library.custom_op("dtmega::recomputed_attention_backward", mutates_args=())
def _attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(g.contiguous() for g in _gradients(grad.contiguous(), q, k, v, causal, scale))


def _gradients(grad, q, k, v, causal: bool, scale: float):
    if q.device.type == "cpu":
        out, lse = block_attention(q, k, v, causal, scale, fused=True)
        return tuple(block_attention_backward(grad, q, k, v, out, lse, causal, scale, fused=True))
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        heads = q.shape[1]
        ke, ve = _expand(k, heads), _expand(v, heads)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, ke, ve, 0.0, causal, False, scale=scale)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, ke, ve, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
        return dq, _fold(dk, k.shape[1]), _fold(dv, v.shape[1])
    out, lse = reference_block_attention(q, k, v, causal, scale)
    return reference_block_attention_backward(grad, q, k, v, out, lse, causal, scale)


@_attention_backward.register_fake
def _(grad, q, k, v, causal, scale):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _setup(ctx, inputs, output) -> None:
    q, k, v, causal, scale = inputs
    ctx.save_for_backward(q, k, v)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = torch.ops.dtmega.recomputed_attention_backward(grad, q, k, v, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


_attention.register_autograd(_backward, setup_context=_setup)


def recomputed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                         scale: float | None = None) -> torch.Tensor:
    """Softmax attention of q [B, H, S, D] over k, v [B, Hkv, S, D] (causal unless told), whose
    backward recomputes it from q, k, v alone (selective activation recompute)."""
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]}, {v.shape[1]})")
    return torch.ops.dtmega.recomputed_attention(q, k, v, causal, _scale(q, scale))
