"""dtmega's FP8 linear on the CPU (the float8 dtypes run there): the CPU's scaled matmul against
torch._scaled_mm (what CUDA runs; torch has a slow CPU version of it), each recipe against a
float64 computation of the same quantize-dequantize math (forward and both gradients: exact up to
fp32 accumulation, 1e-5), against bf16 matmuls (5e-2: FP8's 3-bit mantissa), and delayed
scaling's history and scales step by step."""

from __future__ import annotations

import pytest
import torch

from dtmega.kernels.float8 import E4M3, E5M2, FP8_MAX, Float8Recipe, quantize, scale_from_amax, scaled_mm, scaled_mm_cuda
from dtmega.kernels.float8_linear import Float8State, float8_linear, reduce_and_update_scales
from tests.helpers import relative_error

RECIPES = [Float8Recipe(scaling, fmt, amax_history_len=4) for scaling in ("delayed", "tensorwise", "rowwise")
           for fmt in ("hybrid", "e4m3")]


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 64, generator=g)  # an odd token count
    w = torch.randn(48, 64, generator=g) * 0.1
    grad = torch.randn(37, 48, generator=g)
    return x, w, grad


def _dequantized(t: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    return quantize(t, scale, dtype).double() / scale.double()


def _reference(recipe: Float8Recipe, x, w, grad, scales: tuple | None):
    """The float64 result of the recipe's quantize-dequantize math (tensorwise/delayed: given
    per-tensor scales; rowwise: computed the recipe's way)."""
    fwd, bwd = recipe.forward_dtype, recipe.backward_dtype
    if recipe.scaling == "rowwise":
        sx = scale_from_amax(x.abs().amax(1, keepdim=True), fwd)
        sw = scale_from_amax(w.abs().amax(1, keepdim=True), fwd)
        sg = scale_from_amax(grad.abs().amax(1, keepdim=True), bwd)
        sw_in = scale_from_amax(w.abs().amax(0, keepdim=True), fwd)
        out = _dequantized(x, sx, fwd) @ _dequantized(w, sw, fwd).t()
        grad_x = _dequantized(grad, sg, bwd) @ _dequantized(w, sw_in, fwd)
        grad_w = grad.double().t() @ x.double()
        return out, grad_x, grad_w
    sx, sw, sg = scales
    dx, dw, dg = _dequantized(x, sx, fwd), _dequantized(w, sw, fwd), _dequantized(grad, sg, bwd)
    return dx @ dw.t(), dg @ dw, dg.t() @ dx


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.scaling}-{r.format}")
def test_fp8_linear_is_its_quantize_dequantize_math(recipe):
    x, w, grad = _inputs()
    state = Float8State(recipe.amax_history_len) if recipe.scaling == "delayed" else None
    if state is not None:  # a history as after a step on the same data (delayed scales lag one step)
        state.current.copy_(torch.stack([x.abs().max(), w.abs().max(), grad.abs().max()]))
        reduce_and_update_scales([state], recipe, group=None)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = float8_linear(xl, wl, None, recipe, state)
    out.backward(grad)
    if recipe.scaling == "tensorwise":
        scales = tuple(scale_from_amax(t.abs().max(), d) for t, d in
                       ((x, recipe.forward_dtype), (w, recipe.forward_dtype), (grad, recipe.backward_dtype)))
    else:
        scales = tuple(state.scale) if state is not None else None
    expected = _reference(recipe, x, w, grad, scales)
    # fp32 accumulation of the same FP8 values: rounding only.
    for mine, theirs in zip((out, xl.grad, wl.grad), expected):
        assert relative_error(mine, theirs) < 1e-5
    # Against bf16 matmuls: FP8 keeps 3 (e4m3) or 2 (e5m2) mantissa bits.
    bf16 = x.bfloat16().float() @ w.bfloat16().float().t()
    assert relative_error(out, bf16) < 5e-2


@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3-e4m3", "e5m2-e4m3"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cpu_scaled_matmul_is_torch_scaled_mm(scaling, dtypes, out_dtype):
    """`scaled_mm` off CUDA upcasts to an fp32 matmul; torch._scaled_mm (CUDA's path, and torch's
    slow CPU kernel) accumulates the same exact FP8 products in fp32. Both layouts of b (a weight
    transposed, a contiguous activation), an odd M and K. Bound: fp32 summation order (1e-6
    relative; measured 0), or one bf16 rounding of the output (2^-8) when the output is bf16."""
    g = torch.Generator().manual_seed(3)
    m, k, n = 37, 80, 48
    a = quantize(torch.randn(m, k, generator=g), torch.tensor(20.0), dtypes[0])
    weight = quantize(torch.randn(n, k, generator=g), torch.tensor(40.0), dtypes[1])
    if scaling == "tensor":
        scale_a, scale_b = torch.tensor(20.0), torch.tensor(40.0)
    else:
        scale_a, scale_b = torch.rand(m, 1, generator=g) * 50 + 1, torch.rand(1, n, generator=g) * 50 + 1
    for b in (weight.t(), weight.t().contiguous()):
        mine = scaled_mm(a, b, scale_a, scale_b, out_dtype)
        torch_s = scaled_mm_cuda(a, b, scale_a.reciprocal(), scale_b.reciprocal(), out_dtype)
        assert mine.dtype == torch_s.dtype == out_dtype
        assert relative_error(mine, torch_s) <= (1e-6 if out_dtype == torch.float32 else 2 ** -8)


def test_delayed_scaling_rolls_its_history_and_follows_the_rule():
    recipe = Float8Recipe("delayed", "hybrid", amax_history_len=3, amax_compute_algo="max")
    state = Float8State(3)
    amaxes = [torch.tensor([2.0, 1.0, 4.0]), torch.tensor([8.0, 0.5, 1.0]), torch.tensor([1.0, 0.25, 2.0]),
              torch.tensor([1.0, 0.25, 2.0])]
    limits = torch.tensor([FP8_MAX[E4M3], FP8_MAX[E4M3], FP8_MAX[E5M2]])
    for step, step_amax in enumerate(amaxes):
        state.current.copy_(step_amax)
        reduce_and_update_scales([state], recipe, group=None)
        seen = torch.stack(amaxes[max(0, step - 2):step + 1][::-1], dim=1)  # newest first
        assert torch.equal(state.history[:, :seen.shape[1]], seen)
        assert torch.allclose(state.scale, limits / seen.max(dim=1).values)
        assert torch.equal(state.current, torch.zeros(3))
    recent = Float8Recipe("delayed", "e4m3", amax_history_len=3, amax_compute_algo="most_recent")
    state.current.copy_(torch.tensor([0.5, 0.5, 0.5]))
    reduce_and_update_scales([state], recent, group=None)
    assert torch.allclose(state.scale, torch.full((3,), FP8_MAX[E4M3] / 0.5))
    # An amax of zero (a tensor that never moved) keeps the previous scale.
    before = state.scale.clone()
    state.history.zero_()
    reduce_and_update_scales([state], recent, group=None)
    assert torch.equal(state.scale, before)


def test_bad_recipes_are_refused():
    with pytest.raises(ValueError, match="FP8 scaling 'blockwise' is unknown"):
        Float8Recipe("blockwise")
    with pytest.raises(ValueError, match="amax_history_len must be >= 1"):
        Float8Recipe(amax_history_len=0)
