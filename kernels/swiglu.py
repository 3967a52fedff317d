"""SwiGLU's gate: silu(a) * b, elementwise, in one pass (fp32 math, output in a's dtype).

Two layouts: separate a and b (w1 and w3 as two linears), or packed in one tensor whose last
dim is 2H, a = ab[..., :H] and b = ab[..., H:] (w1 and w3 fused into one weight), read in place
without splitting copies. Backward recomputes sigmoid(a) instead of saving the activation:
    grad_a = g * b * s * (1 + a * (1 - s)),  grad_b = g * a * s,  s = sigmoid(a).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from dtmega.kernels.triton_support import check_impl, kernel_factory, launch, wants_triton


def swiglu(a: torch.Tensor, b: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """silu(a) * b for a, b of the same shape; fp32 math, result in a's dtype."""
    check_impl(impl)
    return torch.ops.dtmega.swiglu(a, b, impl)


def swiglu_packed(ab: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """silu(ab[..., :H]) * ab[..., H:] for ab [..., 2H] -> [..., H]; fp32 math, ab's dtype."""
    check_impl(impl)
    return torch.ops.dtmega.swiglu_packed(ab, impl)


# ---------------------------------------------------------------------------------------------
# Reference (plain PyTorch, fp32 math)


def _forward_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a32 = a.float()
    return (a32 * torch.sigmoid(a32) * b.float()).to(a.dtype)


def _backward_reference(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a32, b32, g32 = a.float(), b.float(), grad.float()
    s = torch.sigmoid(a32)
    grad_a = g32 * b32 * s * (1 + a32 * (1 - s))
    grad_b = g32 * a32 * s
    return grad_a.to(a.dtype), grad_b.to(b.dtype)


# ---------------------------------------------------------------------------------------------
# Triton: a 2-D grid (row, block of columns) over [rows, H]; the inputs' row stride and b's
# column offset cover both layouts (separate: stride H, offset 0; packed: stride 2H, offset H).

_BLOCK = 1024


@kernel_factory
def _kernels():
    global tl  # kernels resolve names in the module's globals (see kernel_factory)
    import triton
    import triton.language as tl

    @triton.jit
    def forward(a_ptr, b_ptr, out_ptr, n_cols, in_stride, b_offset, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        a = tl.load(a_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * in_stride + b_offset + cols, mask=mask, other=0.0).to(tl.float32)
        out = a * (1.0 / (1.0 + tl.exp(-a))) * b
        tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def backward(grad_ptr, a_ptr, b_ptr, grad_a_ptr, grad_b_ptr, n_cols, in_stride, b_offset,
                 BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(grad_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * in_stride + b_offset + cols, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-a))
        grad_a = g * b * s * (1.0 + a * (1.0 - s))
        grad_b = g * a * s
        tl.store(grad_a_ptr + row * in_stride + cols, grad_a.to(grad_a_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_b_ptr + row * in_stride + b_offset + cols, grad_b.to(grad_b_ptr.dtype.element_ty), mask=mask)

    return forward, backward


def _grid(rows: int, cols: int) -> tuple[int, int]:
    import triton

    return rows, triton.cdiv(cols, _BLOCK)


def _forward_triton(a: torch.Tensor, b: torch.Tensor, packed: bool) -> torch.Tensor:
    forward, _ = _kernels()
    h = a.shape[-1] // 2 if packed else a.shape[-1]
    a2 = a.contiguous().view(-1, a.shape[-1])
    b2 = a2 if packed else b.contiguous().view(-1, h)
    out = torch.empty(a2.shape[0], h, device=a.device, dtype=a.dtype)
    if out.numel():
        launch("swiglu_forward", forward, _grid(out.shape[0], h), a2, b2, out, h, a2.shape[1],
               h if packed else 0, BLOCK=_BLOCK)
    return out.view(*a.shape[:-1], h)


def _backward_triton(
    grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, packed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    _, backward = _kernels()
    h = a.shape[-1] // 2 if packed else a.shape[-1]
    a2 = a.contiguous().view(-1, a.shape[-1])
    b2 = a2 if packed else b.contiguous().view(-1, h)
    grad2 = grad.contiguous().view(-1, h)
    grad_a = torch.empty_like(a2)
    grad_b = grad_a if packed else torch.empty_like(b2)
    if grad2.numel():
        launch("swiglu_backward", backward, _grid(grad2.shape[0], h), grad2, a2, b2, grad_a, grad_b, h,
               a2.shape[1], h if packed else 0, BLOCK=_BLOCK)
    return grad_a.view(a.shape), grad_b.view(b.shape)


# ---------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile) with autograd and DTensor sharding rules


@torch.library.custom_op("dtmega::swiglu", mutates_args=())
def _swiglu_op(a: torch.Tensor, b: torch.Tensor, impl: str) -> torch.Tensor:
    if a.shape != b.shape:
        raise ValueError(f"swiglu needs a and b of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if wants_triton(impl, a):
        return _forward_triton(a, b, packed=False)
    return _forward_reference(a, b)


@_swiglu_op.register_fake
def _(a, b, impl):
    return a.new_empty(a.shape)


@torch.library.custom_op("dtmega::swiglu_backward", mutates_args=())
def _swiglu_backward_op(
    grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, impl: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_a, grad_b) of silu(a) * b."""
    if wants_triton(impl, a):
        return _backward_triton(grad, a, b, packed=False)
    return _backward_reference(grad, a, b)


@_swiglu_backward_op.register_fake
def _(grad, a, b, impl):
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _split(ab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if ab.shape[-1] % 2:
        raise ValueError(f"swiglu_packed needs an even last dim (2H), got {ab.shape[-1]}")
    return ab.chunk(2, dim=-1)


@torch.library.custom_op("dtmega::swiglu_packed", mutates_args=())
def _swiglu_packed_op(ab: torch.Tensor, impl: str) -> torch.Tensor:
    a, b = _split(ab)
    if wants_triton(impl, ab):
        return _forward_triton(ab, ab, packed=True)
    return _forward_reference(a, b)


@_swiglu_packed_op.register_fake
def _(ab, impl):
    return ab.new_empty(*ab.shape[:-1], ab.shape[-1] // 2)


@torch.library.custom_op("dtmega::swiglu_packed_backward", mutates_args=())
def _swiglu_packed_backward_op(grad: torch.Tensor, ab: torch.Tensor, impl: str) -> torch.Tensor:
    """grad_ab [..., 2H]: grad_a in the first half of the last dim, grad_b in the second."""
    a, b = _split(ab)
    if wants_triton(impl, ab):
        grad_ab, _ = _backward_triton(grad, ab, ab, packed=True)
        return grad_ab
    return torch.cat(_backward_reference(grad, a, b), dim=-1)


@_swiglu_packed_backward_op.register_fake
def _(grad, ab, impl):
    return ab.new_empty(ab.shape)


def _setup_swiglu(ctx, inputs, output):
    a, b, impl = inputs
    ctx.save_for_backward(a, b)
    ctx.impl = impl


def _swiglu_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad_a, grad_b = torch.ops.dtmega.swiglu_backward(grad, a, b, ctx.impl)
    return grad_a, grad_b, None


def _setup_swiglu_packed(ctx, inputs, output):
    ab, impl = inputs
    ctx.save_for_backward(ab)
    ctx.impl = impl


def _swiglu_packed_backward(ctx, grad):
    (ab,) = ctx.saved_tensors
    return torch.ops.dtmega.swiglu_packed_backward(grad, ab, ctx.impl), None


_swiglu_op.register_autograd(_swiglu_backward, setup_context=_setup_swiglu)
_swiglu_packed_op.register_autograd(_swiglu_packed_backward, setup_context=_setup_swiglu_packed)


# DTensor: the separate layout is elementwise (any dim may be sharded, a and b alike); the
# packed one splits its last dim, so only the other dims may be sharded.


def _rules(ndim: int, n_in: int, n_out: int) -> list:
    rules = [([Replicate()] * n_out, [Replicate()] * n_in + [None])]
    for d in range(ndim):
        rules.append(([Shard(d)] * n_out, [Shard(d)] * n_in + [None]))
    return rules


@register_sharding(torch.ops.dtmega.swiglu.default)
def _(a, b, impl):
    return _rules(len(a.shape), 2, 1)


@register_sharding(torch.ops.dtmega.swiglu_backward.default)
def _(grad, a, b, impl):
    return _rules(len(a.shape), 3, 2)


@register_sharding(torch.ops.dtmega.swiglu_packed.default)
def _(ab, impl):
    return _rules(len(ab.shape) - 1, 1, 1)


@register_sharding(torch.ops.dtmega.swiglu_packed_backward.default)
def _(grad, ab, impl):
    return _rules(len(ab.shape) - 1, 2, 1)
