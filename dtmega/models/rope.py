"""Rotary position embeddings with Llama-3.1 frequency scaling (Meta's interleaved-pair convention)."""

from __future__ import annotations

import math

import torch

from dtmega.models.llama.config import RopeScaling


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Rotation frequency of each pair of channels, [head_dim // 2], fp32."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return freqs.float()
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, blended)
    scaled = torch.where(wavelen < high_freq_wavelen, freqs, scaled)
    return scaled.float()


def rope_cache(
    max_seq_len: int, head_dim: int, theta: float, scaling: RopeScaling | None, device=None
) -> torch.Tensor:
    """cos/sin of every (position, frequency): [max_seq_len, head_dim // 2, 2], fp32."""
    freqs = rope_frequencies(head_dim, theta, scaling).to(device)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotates channel pairs (2i, 2i+1) of x [B, S, H, D] by the angles in cos_sin [B|1, S, D/2, 2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos = cos_sin[..., 0].unsqueeze(2)
    sin = cos_sin[..., 1].unsqueeze(2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)
