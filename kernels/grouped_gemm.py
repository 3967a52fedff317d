"""Grouped GEMM: every expert's tokens times that expert's weight, in one call.

Rows of `x` are sorted by expert (`counts[e]` rows for expert e). `torch._grouped_mm` runs the
whole group as one kernel where this torch has it and the shapes meet its alignment rule
(16-byte strides); otherwise a loop over experts computes the same thing, which is also the
reference the tests compare the grouped kernel against.
"""

from __future__ import annotations

import torch


def grouped_gemm_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True if `torch._grouped_mm` exists and takes these shapes and dtype."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    aligned = 16 // x.element_size()
    return weight.shape[-1] % aligned == 0 and weight.shape[-2] % aligned == 0


def expert_loop_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [N, in] (sorted by expert) @ weight[e].T for each expert's rows: [N, out]."""
    pieces = torch.split(x, counts.tolist())
    return torch.cat([piece @ weight[e].transpose(0, 1) for e, piece in enumerate(pieces)])


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool = True) -> torch.Tensor:
    """x [N, in] rows sorted by expert, weight [E, out, in] (nn.Linear layout per expert),
    counts [E] rows per expert -> [N, out]. `grouped=False` forces the per-expert loop."""
    if grouped and grouped_gemm_available(x, weight):
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return torch.ops.dtmega.grouped_mm(x, weight, offsets)
    return expert_loop_mm(x, weight, counts)


@torch.library.custom_op("dtmega::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


@_grouped_mm_op.register_fake
def _(x, weight, offsets):
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("dtmega::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward_op(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[0] == 0:  # no token reached these experts
        return torch.zeros_like(x), torch.zeros_like(weight)
    grad = grad.contiguous()  # the CPU kernel rejects broadcast (zero-stride) gradients
    grad_x = torch._grouped_mm(grad, weight, offs=offsets)
    # [E, out, in] = per expert grad_rows^T @ x_rows: a grouped GEMM over the token dim.
    grad_w = torch._grouped_mm(grad.transpose(0, 1), x, offs=offsets)
    return grad_x, grad_w


@_grouped_mm_backward_op.register_fake
def _(grad, x, weight, offsets):
    return torch.empty_like(x), torch.empty_like(weight)


def _grouped_mm_backward(ctx, grad):
    x, weight, offsets = ctx.saved_tensors
    grad_x, grad_w = torch.ops.dtmega.grouped_mm_backward(grad, x, weight, offsets)
    return grad_x, grad_w, None


def _setup(ctx, inputs, output):
    x, weight, offsets = inputs
    ctx.save_for_backward(x, weight, offsets)


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_setup)
