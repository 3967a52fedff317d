"""dtmega's own FP8 linear: y = x @ W.T with both operands in FP8 and fp32 accumulation
(`torch._scaled_mm`), backward in FP8 too, for the recipes of `dtmega.kernels.float8`.

Scales are the whole tensor's whatever the plan: every amax is reduced (MAX) over `group`, the
ranks that hold other pieces of the same tensors (tensor-parallel shards of a weight or of a
row-parallel input, data-parallel and context-parallel shards of the batch). Tensorwise and
rowwise recipes reduce inline; delayed scaling records each step's local amaxes in a
`Float8State` and `reduce_and_update_scales` reduces all of a step's amaxes in one collective
afterwards (Transformer Engine's scheme), rolling the histories and computing the next scales.

Rowwise: activations per row and weights per output channel in the forward; in the backward
the input gradient uses the gradient per row and the weight per input channel (re-quantized),
and the weight gradient, whose contraction runs over tokens, stays in high precision (torchao's
"rowwise with high-precision grad weight" recipe).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dtmega.kernels.float8 import Float8Recipe, amax, quantize, scale_from_amax, scaled_mm
from dtmega.kernels.float8_gather import Float8GatheredWeight
from dtmega.kernels.float8_scaling import (  # noqa: F401  (re-exported: the scaling state's users import it here)
    Float8State,
    G,
    W,
    X,
    reduce_and_update_scales,
    reduce_max,
    tensor_scale,
)
from dtmega.kernels.precision import accumulation_dtype


def _row_scale(t: torch.Tensor, dim: int, dtype, recipe: Float8Recipe, group) -> torch.Tensor:
    """Per-row (dim=1) or per-column (dim=0) scales of a 2-D tensor, reduced over `group` (the
    tensor-parallel group when the reduced dim is sharded over it, else None)."""
    return scale_from_amax(reduce_max(amax(t, dim=dim), group), dtype, recipe.margin)


class _Float8Matmul(torch.autograd.Function):
    """x [M, K] @ w[N, K].T in FP8, forward and backward (local tensors). `group` reduces the
    per-tensor amaxes; `tp_group`/`tp_dim` say which weight dim tensor parallelism shards (0:
    output features, 1: input features), so rowwise scales reduce only over sharded dims."""

    @staticmethod
    def forward(ctx, x, w, recipe: Float8Recipe, state, group, tp_group, tp_dim, out_dtype, record):
        fwd = recipe.forward_dtype
        over_k = tp_group if tp_dim == 1 else None  # the input-feature dim is split over TP
        over_n = tp_group if tp_dim == 0 else None  # the output-feature dim is split over TP
        ctx.over = (over_k, over_n)
        if recipe.scaling == "rowwise":
            sx, sw = _row_scale(x, 1, fwd, recipe, over_k), _row_scale(w, 1, fwd, recipe, over_k)
        else:
            sx = tensor_scale(x, X, fwd, recipe, state, group, record)
            # An FP8-gathered weight (--fp8-param-gather) arrives cast, with the whole weight's scale.
            sw = w._scale if isinstance(w, Float8GatheredWeight) else tensor_scale(w, W, fwd, recipe, state, group,
                                                                                    record)
        qx = quantize(x, sx, fwd)
        qw = w._data if isinstance(w, Float8GatheredWeight) else quantize(w, sw, fwd)
        out = scaled_mm(qx, qw.t(), sx, sw.t() if sw.dim() else sw, out_dtype)
        ctx.save_for_backward(qx, sx, qw, sw, w if recipe.scaling == "rowwise" else torch.empty(0),
                              x if recipe.scaling == "rowwise" else torch.empty(0))
        ctx.recipe, ctx.state, ctx.group, ctx.dtypes, ctx.record = recipe, state, group, (x.dtype, w.dtype), record
        return out

    @staticmethod
    def backward(ctx, grad):
        qx, sx, qw, sw, w_hp, x_hp = ctx.saved_tensors
        recipe, bwd = ctx.recipe, ctx.recipe.backward_dtype
        grad = grad.contiguous()
        over_k, over_n = ctx.over
        if recipe.scaling == "rowwise":
            sg = _row_scale(grad, 1, bwd, recipe, over_n)
            sw_in = _row_scale(w_hp, 0, recipe.forward_dtype, recipe, over_n)  # per input channel
            grad_x = scaled_mm(quantize(grad, sg, bwd), quantize(w_hp, sw_in, recipe.forward_dtype), sg, sw_in,
                               ctx.dtypes[0])
            grad_w = (grad.t().to(x_hp.dtype) @ x_hp).to(ctx.dtypes[1])  # contraction over tokens: high precision
            return grad_x, grad_w, None, None, None, None, None, None, None
        sg = tensor_scale(grad, G, bwd, recipe, ctx.state, ctx.group, ctx.record)
        qg = quantize(grad, sg, bwd)
        grad_x = scaled_mm(qg, qw, sg, sw, ctx.dtypes[0])
        grad_w = scaled_mm(qg.t(), qx, sg, sx, accumulation_dtype(ctx.dtypes[1])).to(ctx.dtypes[1])
        return grad_x, grad_w, None, None, None, None, None, None, None


def _output_placements(x: torch.Tensor, w: torch.Tensor):
    """Where a linear's output lives given its input's and weight's placements (one mesh dim)."""
    placement = w.placements[0]
    if isinstance(placement, Shard) and placement.dim == 0:
        return [Shard(-1)]  # column-parallel: each rank has its output features
    if isinstance(placement, Shard):
        return [Partial()]  # row-parallel: partial sums of the input features
    return list(x.placements) if isinstance(x, DTensor) else [Replicate()]


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Float8Recipe,
                  state: Float8State | None, group=None, record: bool = True) -> torch.Tensor:
    """F.linear(x, weight, bias) with the matmul in FP8 (see the module docstring). `weight`
    may be a DTensor sharded on one tensor-parallel mesh dim (x then a DTensor on it too);
    `group` is what per-tensor amaxes are reduced over (None: this rank alone). `record=False`
    keeps this call's amaxes out of delayed scaling's history (evaluation, and the stand-in
    tensors a pipeline stage runs to infer shapes); it still uses the current scales."""
    if recipe.scaling == "delayed" and state is None:
        raise ValueError("delayed scaling needs a Float8State for its amax history")
    column_parallel = isinstance(weight, DTensor) and isinstance(weight.placements[0], Shard) \
        and weight.placements[0].dim % 2 == 0
    # A column-parallel linear's input is replicated and each rank's input gradient is a partial
    # sum over its output features: say so, or the partial sums would never be reduced.
    local_x = x.to_local(grad_placements=[Partial()] if column_parallel else None) if isinstance(x, DTensor) else x
    local_w = weight.to_local() if isinstance(weight, DTensor) else weight
    out_dtype = local_x.dtype if local_x.dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16) \
        else torch.float32
    if torch.is_autocast_enabled(local_x.device.type):
        out_dtype = torch.get_autocast_dtype(local_x.device.type)
    flat = local_x.reshape(-1, local_x.shape[-1])
    tp_group = tp_dim = None
    if isinstance(weight, DTensor) and isinstance(weight.placements[0], Shard):
        tp_group, tp_dim = weight.device_mesh.get_group(), weight.placements[0].dim % 2
    out = _Float8Matmul.apply(flat, local_w, recipe, state, group, tp_group, tp_dim, out_dtype, record)
    out = out.view(*local_x.shape[:-1], -1)
    if isinstance(weight, DTensor):
        out = DTensor.from_local(out, weight.device_mesh, _output_placements(x, weight), run_check=False)
    if bias is not None:
        out = out + bias
    return out
