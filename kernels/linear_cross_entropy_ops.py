"""fused linear cross entropy's custom ops (opaque to torch.compile) with autograd and
DTensor sharding rules, for plain (not vocab-sharded) tensors."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from dtmega.kernels.linear_cross_entropy_core import _backward, _forward, _Options

# ---------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile) with autograd, for plain (unsharded) tensors


@torch.library.custom_op("dtmega::linear_cross_entropy", mutates_args=())
def _lce_op(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, chunk_size: int,
    z_loss: float, impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    opts = _Options(ignore_index, chunk_size, z_loss, impl)
    loss, lse, _, _ = _forward(hidden, weight, labels, None, opts, compute_grad=False)
    return loss, lse


@_lce_op.register_fake
def _(hidden, weight, labels, ignore_index, chunk_size, z_loss, impl):
    n = hidden.shape[0]
    return hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("dtmega::linear_cross_entropy_backward", mutates_args=())
def _lce_backward_op(
    grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
    ignore_index: int, chunk_size: int, z_loss: float, impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight) of sum grad_loss_i * loss_i, recomputing the logits by chunk."""
    return _backward(grad_loss, hidden, weight, labels, lse, _Options(ignore_index, chunk_size, z_loss, impl))


@_lce_backward_op.register_fake
def _(grad_loss, hidden, weight, labels, lse, ignore_index, chunk_size, z_loss, impl):
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)


def _setup_lce(ctx, inputs, output):
    hidden, weight, labels, ignore_index, chunk_size, z_loss, impl = inputs
    ctx.save_for_backward(hidden, weight, labels, output[1])
    ctx.args = (ignore_index, chunk_size, z_loss, impl)


def _lce_backward(ctx, grad_loss, _grad_lse):
    hidden, weight, labels, lse = ctx.saved_tensors
    grad_hidden, grad_weight = torch.ops.dtmega.linear_cross_entropy_backward(
        grad_loss, hidden, weight, labels, lse, *ctx.args)
    return grad_hidden, grad_weight, None, None, None, None, None


_lce_op.register_autograd(_lce_backward, setup_context=_setup_lce)


@torch.library.custom_op("dtmega::linear_cross_entropy_sum", mutates_args=())
def _lce_sum_op(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, token_weights: torch.Tensor,
    ignore_index: int, chunk_size: int, z_loss: float, compute_grad: bool, impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum_i token_weights_i * loss_i, grad_hidden, grad_weight); the gradients are empty
    ([0]) unless compute_grad."""
    opts = _Options(ignore_index, chunk_size, z_loss, impl)
    scale = token_weights.float()
    loss, _, grad_hidden, grad_weight = _forward(hidden, weight, labels, scale, opts, compute_grad)
    if not compute_grad:
        grad_hidden, grad_weight = hidden.new_empty(0), weight.new_empty(0)
    return (loss * scale).sum(), grad_hidden, grad_weight


@_lce_sum_op.register_fake
def _(hidden, weight, labels, token_weights, ignore_index, chunk_size, z_loss, compute_grad, impl):
    total = hidden.new_empty((), dtype=torch.float32)
    if not compute_grad:
        return total, hidden.new_empty(0), weight.new_empty(0)
    return total, hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)


def _setup_lce_sum(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])


def _lce_sum_backward(ctx, grad_total, _grad_hidden, _grad_weight):
    grad_hidden, grad_weight = ctx.saved_tensors
    if grad_hidden.numel() != 0 or grad_weight.numel() != 0:
        grad_hidden, grad_weight = grad_hidden * grad_total, grad_weight * grad_total
    else:
        raise RuntimeError("fused_linear_cross_entropy_sum ran its forward without computing gradients "
                           "(grad mode off, or neither hidden nor weight required grad)")
    return grad_hidden, grad_weight, None, None, None, None, None, None, None


_lce_sum_op.register_autograd(_lce_sum_backward, setup_context=_setup_lce_sum)


# DTensor (weight replicated): tokens are independent, so hidden, labels (and token weights)
# sharded alike on the token dim run locally; grad_weight and the weighted sum are then Partial.


@register_sharding(torch.ops.dtmega.linear_cross_entropy.default)
def _(hidden, weight, labels, ignore_index, chunk_size, z_loss, impl):
    rest = [None] * 4
    return [([Replicate()] * 2, [Replicate()] * 3 + rest),
            ([Shard(0)] * 2, [Shard(0), Replicate(), Shard(0)] + rest)]


@register_sharding(torch.ops.dtmega.linear_cross_entropy_backward.default)
def _(grad_loss, hidden, weight, labels, lse, ignore_index, chunk_size, z_loss, impl):
    rest = [None] * 4
    return [([Replicate()] * 2, [Replicate()] * 5 + rest),
            ([Shard(0), Partial()], [Shard(0), Shard(0), Replicate(), Shard(0), Shard(0)] + rest)]


@register_sharding(torch.ops.dtmega.linear_cross_entropy_sum.default)
def _(hidden, weight, labels, token_weights, ignore_index, chunk_size, z_loss, compute_grad, impl):
    rest = [None] * 5
    return [([Replicate()] * 3, [Replicate()] * 4 + rest),
            ([Partial(), Shard(0), Partial()], [Shard(0), Replicate(), Shard(0), Shard(0)] + rest)]




# Under CUDA autocast (one-rank bf16 training, plain scripts) the hidden states and the weight
# arrive in fp32; the loss's matmuls run in bf16 like every other matmul of the step.
for _op in ("dtmega::linear_cross_entropy", "dtmega::linear_cross_entropy_sum"):
    torch.library.register_autocast(_op, "cuda", torch.bfloat16)
