"""RoPE frequencies of the DeepSeek family: plain, or stretched by YaRN.

Computed in float32 the way transformers' DeepSeek-V3 computes them (its checkpoints are the
reference), then laid out as dtmega's cos/sin table (models/rope.py), which rotates adjacent
channel pairs: DeepSeek's own interleaved convention (HF `rope_interleave=True`).
"""

from __future__ import annotations

import math

import torch

from dtmega.models.deepseek.config import YarnScaling


def yarn_frequencies(dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """[dim // 2] rotation frequencies: theta^(-2i/dim), blended by YaRN's ramp towards
    frequency / factor for the long wavelengths."""
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1.0 / base
    if yarn is None:
        return extrapolated
    interpolated = 1.0 / (yarn.factor * base)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (short wavelengths), 0: interpolate
    return interpolated * (1 - keep) + extrapolated * keep


def deepseek_rope_cache(max_seq_len: int, dim: int, theta: float, yarn: YarnScaling | None, device=None) -> torch.Tensor:
    """cos/sin of every (position, frequency): [max_seq_len, dim // 2, 2], fp32."""
    freqs = yarn_frequencies(dim, theta, yarn).to(device)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)
