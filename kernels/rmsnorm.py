"""RMSNorm, alone or fused with the residual add that precedes it in every transformer block.

y = x * rsqrt(mean(x^2) + eps) * weight, in fp32, returned in x's dtype. The fused variant
computes h = x + residual (in x's dtype) and y = rms_norm(h) in one pass, and its backward
takes the gradients of both y and h, so a block's residual stream costs one read and one write.

Forward saves the input (h for the fused variant) and rstd = rsqrt(mean(x^2) + eps) [rows]
fp32. Backward, with xhat = x * rstd and g' = grad_y * weight:
    grad_x = rstd * (g' - xhat * mean(g' * xhat)) (+ grad_h)
    grad_weight = sum over rows of grad_y * xhat (fp32; Triton sums per-program partials).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from dtmega.kernels.triton_support import (
    check_impl,
    kernel_factory,
    launch,
    num_warps_for,
    persistent_programs,
    wants_triton,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, impl: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dim: x [..., D], weight [D] -> y [..., D] in x's dtype (fp32 math)."""
    check_impl(impl)
    y, _ = torch.ops.dtmega.rms_norm(x, weight, float(eps), impl)
    return y


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (x's dtype) and y = rms_norm(h, weight, eps), fused: returns (y, h)."""
    check_impl(impl)
    y, h, _ = torch.ops.dtmega.rms_norm_residual(x, residual, weight, float(eps), impl)
    return y, h


# ---------------------------------------------------------------------------------------------
# Reference (plain PyTorch, fp32 math)


def _forward_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1) + eps)
    return (x32 * rstd.unsqueeze(-1) * weight.float()).to(x.dtype), rstd


def _backward_reference(
    grad_y: torch.Tensor, grad_h: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rstd = rstd.unsqueeze(-1)
    xhat = x.float() * rstd
    grad_y32 = grad_y.float()
    scaled = grad_y32 * weight.float()
    grad_x = rstd * (scaled - xhat * (scaled * xhat).mean(-1, keepdim=True))
    if grad_h is not None:
        grad_x = grad_x + grad_h.float()
    grad_weight = (grad_y32 * xhat).reshape(-1, x.shape[-1]).sum(0)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


# ---------------------------------------------------------------------------------------------
# Triton: one program per row forward; persistent programs over row ranges backward.


@kernel_factory
def _kernels():
    global tl  # kernels resolve names in the module's globals (see kernel_factory)
    import triton
    import triton.language as tl

    @triton.jit
    def forward(x_ptr, res_ptr, h_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps,
                HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        offsets = row * n_cols + cols
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + offsets, mask=mask, other=0.0)
            h = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # rounded like torch's add
            tl.store(h_ptr + offsets, h, mask=mask)
            x = h
        x32 = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offsets, (x32 * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def backward(grad_y_ptr, grad_h_ptr, x_ptr, w_ptr, rstd_ptr, grad_x_ptr, partial_ptr,
                 n_rows, n_cols, rows_per_program, HAS_GRAD_H: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        col_mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        grad_w = tl.zeros([BLOCK], dtype=tl.float32)
        first = pid.to(tl.int64) * rows_per_program
        for i in range(rows_per_program):
            row = first + i
            live = row < n_rows
            # No row past the end (a bool '&' of a block and a scalar trips the interpreter).
            mask = cols < tl.where(live, n_cols, 0)
            offsets = row * n_cols + cols
            grad_y = tl.load(grad_y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row, mask=live, other=0.0)
            xhat = x * rstd
            grad_w += grad_y * xhat
            scaled = grad_y * w
            grad_x = rstd * (scaled - xhat * (tl.sum(scaled * xhat, axis=0) / n_cols))
            if HAS_GRAD_H:
                grad_x += tl.load(grad_h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
        tl.store(partial_ptr + pid.to(tl.int64) * n_cols + cols, grad_w, mask=col_mask)

    return forward, backward


def _forward_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    import triton

    forward, _ = _kernels()
    d = x.shape[-1]
    x2 = x.contiguous().view(-1, d)
    rows = x2.shape[0]
    y = torch.empty_like(x2)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    h = torch.empty_like(x2) if residual is not None else None
    res2 = residual.to(x.dtype).contiguous().view(-1, d) if residual is not None else x2
    block = triton.next_power_of_2(d)
    if rows:
        launch("rms_norm_forward", forward, (rows,), x2, res2, h if h is not None else y, weight.contiguous(),
               y, rstd, d, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps_for(block))
    shape = x.shape
    return y.view(shape), rstd.view(shape[:-1]), (h.view(shape) if h is not None else None)


def _backward_triton(
    grad_y: torch.Tensor, grad_h: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    _, backward = _kernels()
    d = x.shape[-1]
    x2 = x.contiguous().view(-1, d)
    rows = x2.shape[0]
    grad_y2 = grad_y.contiguous().view(-1, d)
    grad_h2 = grad_h.contiguous().view(-1, d) if grad_h is not None else grad_y2
    grad_x = torch.empty_like(x2)
    programs = persistent_programs(x, rows)
    partial = torch.empty(programs, d, device=x.device, dtype=torch.float32)
    block = triton.next_power_of_2(d)
    if rows:
        launch("rms_norm_backward", backward, (programs,), grad_y2, grad_h2, x2, weight.contiguous(),
               rstd.contiguous().view(-1), grad_x, partial, rows, d, triton.cdiv(rows, programs),
               HAS_GRAD_H=grad_h is not None, BLOCK=block, num_warps=num_warps_for(block))
    else:
        partial.zero_()
    return grad_x.view(x.shape), partial.sum(0).to(weight.dtype)


# ---------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile) with autograd and DTensor sharding rules


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match x's last dim {x.shape[-1]}")


@torch.library.custom_op("dtmega::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, weight)
    if wants_triton(impl, x):
        y, rstd, _ = _forward_triton(x, None, weight, eps)
        return y, rstd
    return _forward_reference(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps, impl):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("dtmega::rms_norm_residual", mutates_args=())
def _rms_norm_residual_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, impl: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if wants_triton(impl, x):
        y, rstd, h = _forward_triton(x, residual, weight, eps)
        return y, h, rstd
    h = x + residual.to(x.dtype)
    y, rstd = _forward_reference(h, weight, eps)
    return y, h, rstd


@_rms_norm_residual_op.register_fake
def _(x, residual, weight, eps, impl):
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("dtmega::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    grad_y: torch.Tensor, grad_h: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor,
    rstd: torch.Tensor, impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight) of y = rms_norm(x); grad_h (if given) is added to grad_x: the
    gradient h = x + residual receives from its other consumers (the residual stream)."""
    if wants_triton(impl, x):
        return _backward_triton(grad_y, grad_h, x, weight, rstd)
    return _backward_reference(grad_y, grad_h, x, weight, rstd)


@_rms_norm_backward_op.register_fake
def _(grad_y, grad_h, x, weight, rstd, impl):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_rms_norm(ctx, inputs, output):
    x, weight, _, impl = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.impl = impl


def _rms_norm_backward(ctx, grad_y, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    grad_x, grad_weight = torch.ops.dtmega.rms_norm_backward(grad_y, None, x, weight, rstd, ctx.impl)
    return grad_x, grad_weight, None, None


def _setup_rms_norm_residual(ctx, inputs, output):
    _, residual, weight, _, impl = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.impl, ctx.residual_dtype = impl, residual.dtype


def _rms_norm_residual_backward(ctx, grad_y, grad_h, _grad_rstd):
    h, weight, rstd = ctx.saved_tensors
    if grad_y is None:
        grad_y = torch.zeros_like(h)
    grad_x, grad_weight = torch.ops.dtmega.rms_norm_backward(grad_y, grad_h, h, weight, rstd, ctx.impl)
    return grad_x, grad_x.to(ctx.residual_dtype), grad_weight, None, None


_rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_setup_rms_norm)
_rms_norm_residual_op.register_autograd(_rms_norm_residual_backward, setup_context=_setup_rms_norm_residual)


# DTensor: rows are independent, so any sharding of a non-last dim (or full replication) runs
# on the local shards as they are; the weight stays replicated and its gradient, a sum over
# the local rows only, is Partial.


def _row_dims(x) -> range:
    return range(len(x.shape) - 1)


@register_sharding(torch.ops.dtmega.rms_norm.default)
def _(x, weight, eps, impl):
    rules = [([Replicate(), Replicate()], [Replicate(), Replicate(), None, None])]
    for d in _row_dims(x):
        rules.append(([Shard(d), Shard(d)], [Shard(d), Replicate(), None, None]))
    return rules


@register_sharding(torch.ops.dtmega.rms_norm_residual.default)
def _(x, residual, weight, eps, impl):
    rules = [([Replicate()] * 3, [Replicate()] * 3 + [None, None])]
    for d in _row_dims(x):
        rules.append(([Shard(d)] * 3, [Shard(d), Shard(d), Replicate(), None, None]))
    return rules


@register_sharding(torch.ops.dtmega.rms_norm_backward.default)
def _(grad_y, grad_h, x, weight, rstd, impl):
    def maybe(p):
        return p if grad_h is not None else None

    rules = [([Replicate(), Replicate()], [Replicate(), maybe(Replicate())] + [Replicate()] * 3 + [None])]
    for d in _row_dims(x):
        rules.append(([Shard(d), Partial()], [Shard(d), maybe(Shard(d)), Shard(d), Replicate(), Shard(d), None]))
    return rules
