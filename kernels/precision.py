"""The dtype kernels compute softmaxes, log-sum-exps and accumulations in."""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for reduced-precision inputs (bf16, fp16) and fp32 ones, float64 for float64 ones:
    kernels upcast what they accumulate to at least fp32, and never round a float64 model (the
    suite's exactness checks) down to it."""
    return torch.promote_types(dtype, torch.float32)
