"""The attention kernels a plan can choose for causal training attention, and how each runs.

Candidates (`BACKENDS`): torch's scaled_dot_product_attention restricted to one of its
kernels (`flash`: FlashAttention-2; `cudnn`: cuDNN's fused attention, what Transformer
Engine's "fused" backend calls; `efficient`: the memory-efficient kernel; `math`: the unfused
softmax(q k^T) v in plain PyTorch ops), and FlexAttention with a causal BlockMask (`flex`,
compiled on CUDA). Megatron's `--attention-backend` names map onto them (`MEGATRON_BACKENDS`);
`auto` is a measured choice (kernels/attention_choice.py).

Every candidate computes the same causal attention over [B, S, H, D] queries and [B, S, Hkv, D]
keys/values (grouped-query: key/value heads repeated), so each is checked against `math`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

# candidate -> the device types it trains on (torch's CPU build has flash and math kernels;
# FlexAttention has no backward on the CPU)
BACKENDS: dict[str, tuple[str, ...]] = {
    "flash": ("cuda", "cpu"), "cudnn": ("cuda",), "efficient": ("cuda",), "math": ("cuda", "cpu"), "flex": ("cuda",),
}
# Megatron-LM's --attention-backend -> the candidate it names (auto: measured)
MEGATRON_BACKENDS = {"flash": "flash", "fused": "cudnn", "unfused": "math", "local": "math", "auto": "auto"}
# when measured times tie (within the measurement's noise), the first of these wins: every rank
# then picks the same kernel from its own measurement
PREFERENCE = ("flash", "cudnn", "efficient", "flex", "math")


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


@contextlib.contextmanager
def only_backend(name: str) -> Iterator[None]:
    """scaled_dot_product_attention restricted to the kernel `name` (an SDPA candidate)."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([_sdpa_backend(name)]):
        yield


@functools.lru_cache(maxsize=32)
def _causal_block_mask(seq_q: int, seq_k: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    offset = seq_k - seq_q
    return create_block_mask(lambda b, h, q, k: k <= q + offset, None, None, seq_q, seq_k, device=device)


@functools.lru_cache(maxsize=1)
def _flex(device_type: str) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if device_type == "cuda" else flex_attention


def causal_attention(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [B, S, H, D] over k, v [B, S, Hkv, D] by the candidate `backend`;
    out [B, S, H, Dv]."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    grouped = q.shape[2] != k.shape[2]
    if backend == "flex":
        mask = _causal_block_mask(q.shape[1], k.shape[1], str(q.device))
        out = _flex(q.device.type)(qt, kt, vt, block_mask=mask, enable_gqa=grouped)
    else:
        with only_backend(backend):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=grouped)
    return out.transpose(1, 2)


def available(backend: str, device_type: str) -> bool:
    """Whether `backend` can run on `device_type` at all (whether it takes a given shape and
    dtype, only running it tells: the measurement drops a candidate that raises)."""
    return device_type in BACKENDS.get(backend, ())
