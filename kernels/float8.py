"""FP8 quantization and scaled matmuls: the arithmetic of every FP8 recipe dtmega runs.

A tensor x is quantized as q = clamp(x * s, -max, max).to(fp8) with a scale s, and
dequantized as q / s; `torch._scaled_mm(qa, qb, 1/sa, 1/sb)` multiplies two quantized
operands with fp32 accumulation. Recipes differ only in where s comes from:

* tensorwise ("current"): s = max_fp8 / amax(x) of this very tensor, per tensor;
* rowwise: one s per row of the left operand and per column of the right one;
* delayed (Megatron's and Transformer Engine's default): s = max_fp8 / amax over a history of
  earlier steps' amaxes (`Float8Recipe.amax_history_len`, `amax_compute_algo` max or
  most_recent), so no reduction waits in the forward; the step's own amax joins the history.

Formats: "e4m3" everywhere, or "hybrid" = e4m3 for activations and weights, e5m2 (more range,
less precision) for gradients. On CUDA the product is `torch._scaled_mm` (H100 and newer: FP8
tensor cores); on the CPU it is the same arithmetic in an fp32 matmul (`scaled_mm` says why that is
exact), which is how the suite checks the recipes on machines without a GPU: torch's CPU
`_scaled_mm` gives the same numbers ~1000x slower (tests/unit/test_float8.py holds the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtmega.kernels.precision import accumulation_dtype

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
SCALINGS = ("delayed", "tensorwise", "rowwise")
FORMATS = ("hybrid", "e4m3")
AMAX_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class Float8Recipe:
    """How an FP8 linear scales its operands (see the module docstring)."""

    scaling: str = "delayed"
    format: str = "hybrid"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0  # scales are divided by 2**margin (Transformer Engine's headroom)

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"FP8 scaling {self.scaling!r} is unknown; use one of {SCALINGS}")
        if self.format not in FORMATS:
            raise ValueError(f"FP8 format {self.format!r} is unknown; use one of {FORMATS}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"amax_compute_algo {self.amax_compute_algo!r} is unknown; use one of {AMAX_ALGOS}")
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")

    @property
    def forward_dtype(self) -> torch.dtype:
        """FP8 type of activations and weights."""
        return E4M3

    @property
    def backward_dtype(self) -> torch.dtype:
        """FP8 type of gradients (e5m2 in the hybrid format)."""
        return E5M2 if self.format == "hybrid" else E4M3


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0,
                    previous: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 scale(s) max_fp8 / amax / 2**margin; where amax is 0 or not finite, the previous
    scale (or 1) is kept, as Transformer Engine does."""
    amax = amax.float()
    scale = FP8_MAX[dtype] / amax / (2.0 ** margin)
    keep = previous if previous is not None else torch.ones_like(scale)
    return torch.where(torch.isfinite(scale) & (amax > 0), scale, keep)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """clamp(x * scale) to the FP8 type's range, cast to it (scale broadcasts: per tensor, row or
    column). x * scale is taken in fp32, or in float64 for a float64 x (no rounding before the cast)."""
    limit = FP8_MAX[dtype]
    return (x.to(accumulation_dtype(x.dtype)) * scale).clamp(-limit, limit).to(dtype)


def amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x| (fp32), over everything or along `dim` (keeping it); 0 for an empty x (a rank's
    share of an unevenly sharded tensor may be empty)."""
    x = x.detach()
    if dim is None:
        return x.abs().max().float() if x.numel() else torch.zeros((), device=x.device)
    return x.abs().amax(dim=dim, keepdim=True).float()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a / scale_a) @ (b / scale_b) for FP8 a [M, K], b [K, N] with fp32 accumulation; the
    layouts cuBLAS wants (a row-major, b column-major) are made here.

    On CUDA this is `torch._scaled_mm`. Elsewhere the same arithmetic runs as an fp32 matmul of
    the upcast operands, the scales applied to the accumulator afterwards as `_scaled_mm` applies
    them: every FP8 value is exact in fp32, and so is the product of two (at most 4 significant
    bits each), so both accumulate the very same products in fp32 and differ only in summation
    order. torch's CPU `_scaled_mm` took 76-624 ms for a [256, 64] x [64, 64-512] product that
    the fp32 matmul does in 0.1-0.4 ms, with identical results (tests/unit/test_float8.py keeps
    checking the two against each other).

    For a float64 result the product is accumulated in float64 instead (`torch._scaled_mm`
    accumulates in fp32 whatever its output type): each FP8 value times its fp32 inverse scale
    is exact in float64, so the result is the exact quantized product up to float64 rounding.
    Float64 models are how the suite shows that a sharded FP8 run quantizes to the very same
    values as one rank (tests/distributed/test_float8.py); nothing fast runs in float64."""
    inverse_a, inverse_b = scale_a.reciprocal().float(), scale_b.reciprocal().float()
    if out_dtype == torch.float64:
        return (a.double() * inverse_a.double()) @ (b.double() * inverse_b.double())
    if a.device.type != "cuda":
        return ((a.float() @ b.float()) * (inverse_a * inverse_b)).to(out_dtype)
    return scaled_mm_cuda(a, b, inverse_a, inverse_b, out_dtype)


def scaled_mm_cuda(a: torch.Tensor, b: torch.Tensor, inverse_a: torch.Tensor, inverse_b: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """`torch._scaled_mm` with the operand layouts cuBLAS wants (a row-major, b column-major),
    given the inverse scales; any device torch has the op for (tests call it on the CPU to hold
    `scaled_mm`'s fp32 path equal to it)."""
    a = a if a.is_contiguous() else a.contiguous()
    b = b if b.t().is_contiguous() else b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=inverse_a, scale_b=inverse_b, out_dtype=out_dtype)
