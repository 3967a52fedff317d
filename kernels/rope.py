"""Rotary position embeddings applied to q and k together (Meta's interleaved-pair convention).

Channels (2i, 2i+1) of every head are rotated by angle_i of the token's position:
(x0 * cos - x1 * sin, x0 * sin + x1 * cos), in fp32, returned in the input dtype. The cos/sin
come from a cache [max_seq, D/2, 2] fp32 (dtmega.models.rope.rope_cache's output); the Triton
kernel gathers each token's row by position inside the kernel, so no [B, S, D/2, 2] table is
materialized, and one launch covers q and k (whose head counts may differ: GQA). The backward
is the same rotation by -angle.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from dtmega.kernels.triton_support import check_impl, kernel_factory, launch, num_warps_for, wants_triton


def apply_rope_qk(
    q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor, position_ids: torch.Tensor | None = None,
    *, impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [B, S, Hq, D] and k [B, S, Hk, D] by the angles of `position_ids` [B, S] int64
    (None: positions 0..S-1 in every sequence), reading cos/sin from `cache` [max_seq, D/2, 2]."""
    check_impl(impl)
    return torch.ops.dtmega.rope_qk(q, k, cache, position_ids, impl)


# ---------------------------------------------------------------------------------------------
# Reference (plain PyTorch, fp32 math; the same arithmetic as dtmega.models.rope.apply_rope)


def _cos_sin(cache: torch.Tensor, position_ids: torch.Tensor | None, seq: int) -> torch.Tensor:
    return cache[:seq].unsqueeze(0) if position_ids is None else cache[position_ids]


def _rotate_reference(x: torch.Tensor, cos_sin: torch.Tensor, sign: float) -> torch.Tensor:
    pairs = x.float().unflatten(-1, (-1, 2))
    cos = cos_sin[..., 0].unsqueeze(2)
    sin = cos_sin[..., 1].unsqueeze(2) * sign
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype).contiguous()


def _rope_reference(q, k, cache, position_ids, sign: float) -> tuple[torch.Tensor, torch.Tensor]:
    cos_sin = _cos_sin(cache.float(), position_ids, q.shape[1])
    return _rotate_reference(q, cos_sin, sign), _rotate_reference(k, cos_sin, sign)


# ---------------------------------------------------------------------------------------------
# Triton: one program per token (b, s) rotates all of its q heads and k heads.


@kernel_factory
def _kernels():
    global tl, _rotate_heads  # kernels resolve names in the module's globals (see kernel_factory)
    import triton
    import triton.language as tl

    @triton.jit
    def _rotate_heads(x_ptr, out_ptr, n_heads, head_stride, cos, sin, channels, partner, dim,
                      BLOCK_H: tl.constexpr):
        """out[c] = x[c] * cos + x[c ^ 1] * sin (sin signed per channel), for all heads. Rows are
        read and written contiguously; the partner read hits the same cache lines."""
        heads = tl.arange(0, BLOCK_H)[:, None]
        mask = (heads < n_heads) & (channels < dim)
        src = x_ptr + heads * head_stride
        x = tl.load(src + channels, mask=mask, other=0.0).to(tl.float32)
        x_partner = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32)
        out = x * cos + x_partner * sin
        tl.store(out_ptr + heads * dim + channels, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rope(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cache_ptr, pos_ptr, seq, n_q, n_k, dim,
             q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, pos_sb, pos_ss, sign,
             HAS_POS: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        b = token // seq
        s = token % seq
        if HAS_POS:
            position = tl.load(pos_ptr + b * pos_sb + s * pos_ss).to(tl.int64)
        else:
            position = s
        channels = tl.arange(0, BLOCK_D)
        odd = channels % 2
        # Pair i = (2i, 2i+1): out[2i] = x0 cos - x1 sin, out[2i+1] = x1 cos + x0 sin.
        cache_row = cache_ptr + position * dim + (channels - odd)
        cos = tl.load(cache_row, mask=channels < dim, other=0.0)[None, :]
        sin = tl.load(cache_row + 1, mask=channels < dim, other=0.0)[None, :] * (sign * (2 * odd - 1))[None, :]
        partner = (channels + 1 - 2 * odd)[None, :]
        channels = channels[None, :]
        _rotate_heads(q_ptr + b * q_sb + s * q_ss, q_out_ptr + token * n_q * dim, n_q, q_sh,
                      cos, sin, channels, partner, dim, BLOCK_HQ)
        _rotate_heads(k_ptr + b * k_sb + s * k_ss, k_out_ptr + token * n_k * dim, n_k, k_sh,
                      cos, sin, channels, partner, dim, BLOCK_HK)

    return rope


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rope_triton(q, k, cache, position_ids, sign: float) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    rope = _kernels()
    batch, seq, n_q, dim = q.shape
    n_k = k.shape[2]
    q, k = _last_dim_dense(q), _last_dim_dense(k)  # other strides (views of a fused qkv) are fine
    cache = cache.float().contiguous()
    q_out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    k_out = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    if position_ids is not None:
        pos = position_ids.expand(batch, seq)
        pos_strides = pos.stride()
    else:
        pos, pos_strides = cache, (0, 0)  # unused pointer
    block_d = triton.next_power_of_2(dim)
    block_hq, block_hk = triton.next_power_of_2(n_q), triton.next_power_of_2(n_k)
    if batch * seq:
        launch("rope_qk", rope, (batch * seq,), q, k, q_out, k_out, cache, pos, seq, n_q, n_k, dim,
               q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               pos_strides[0], pos_strides[1], sign, HAS_POS=position_ids is not None,
               BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d,
               num_warps=num_warps_for(max(block_hq, block_hk) * block_d))
    return q_out, k_out


def _rope(q, k, cache, position_ids, impl: str, sign: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q.ndim != 4 or k.ndim != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1] or q.shape[-1] % 2:
        raise ValueError(
            f"rope needs q [B, S, Hq, D] and k [B, S, Hk, D] with even D, got {tuple(q.shape)}, {tuple(k.shape)}")
    if cache.shape[1:] != (q.shape[-1] // 2, 2):
        raise ValueError(f"cache {tuple(cache.shape)} is not [max_seq, {q.shape[-1] // 2}, 2]")
    if wants_triton(impl, q):
        return _rope_triton(q, k, cache, position_ids, sign)
    return _rope_reference(q, k, cache, position_ids, sign)


# ---------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile) with autograd and DTensor sharding rules


@torch.library.custom_op("dtmega::rope_qk", mutates_args=())
def _rope_qk_op(
    q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor, position_ids: torch.Tensor | None, impl: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope(q, k, cache, position_ids, impl, 1.0)


@_rope_qk_op.register_fake
def _(q, k, cache, position_ids, impl):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("dtmega::rope_qk_backward", mutates_args=())
def _rope_qk_backward_op(
    grad_q: torch.Tensor, grad_k: torch.Tensor, cache: torch.Tensor, position_ids: torch.Tensor | None, impl: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of q and k: the output gradients rotated back (by -angle)."""
    return _rope(grad_q, grad_k, cache, position_ids, impl, -1.0)


@_rope_qk_backward_op.register_fake
def _(grad_q, grad_k, cache, position_ids, impl):
    return grad_q.new_empty(grad_q.shape), grad_k.new_empty(grad_k.shape)


def _setup_rope(ctx, inputs, output):
    q, k, cache, position_ids, impl = inputs
    ctx.save_for_backward(cache, position_ids)
    ctx.impl = impl
    ctx.like = [(q.shape, q.dtype, q.device), (k.shape, k.dtype, k.device)]


def _rope_backward(ctx, grad_q, grad_k):
    cache, position_ids = ctx.saved_tensors
    grad_q, grad_k = (
        torch.zeros(shape, dtype=dtype, device=device) if grad is None else grad
        for grad, (shape, dtype, device) in zip((grad_q, grad_k), ctx.like)
    )
    grad_q, grad_k = torch.ops.dtmega.rope_qk_backward(grad_q, grad_k, cache, position_ids, ctx.impl)
    return grad_q, grad_k, None, None, None


_rope_qk_op.register_autograd(_rope_backward, setup_context=_setup_rope)


# DTensor: tokens and heads are independent. q and k may be sharded alike on batch (0), heads
# (2), or sequence (1) when position_ids are given and sharded the same way (without them the
# positions would restart at 0 on every sequence shard); cos/sin (the cache) stay replicated.


def _rope_rules(position_ids) -> list:
    has_pos = position_ids is not None
    rules = [([Replicate()] * 2, [Replicate()] * 3 + [Replicate() if has_pos else None, None])]
    rules.append(([Shard(0)] * 2, [Shard(0), Shard(0), Replicate(), Shard(0) if has_pos else None, None]))
    rules.append(([Shard(2)] * 2, [Shard(2), Shard(2), Replicate(), Replicate() if has_pos else None, None]))
    if has_pos:
        rules.append(([Shard(1)] * 2, [Shard(1), Shard(1), Replicate(), Shard(1), None]))
    return rules


@register_sharding(torch.ops.dtmega.rope_qk.default)
def _(q, k, cache, position_ids, impl):
    return _rope_rules(position_ids)


@register_sharding(torch.ops.dtmega.rope_qk_backward.default)
def _(grad_q, grad_k, cache, position_ids, impl):
    return _rope_rules(position_ids)
