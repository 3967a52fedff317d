"""How many sequences the server's KV cache holds: slots sized from a memory budget.

A slot holds one sequence of up to `--max-model-len` positions (default: the model's context),
keys and values of every block for this rank's KV heads. The budget is `--kv-cache-memory`
(bytes), or `--gpu-memory-utilization` (vLLM's meaning: the fraction of the device's memory the
server may take, weights included; on the CPU, of the host memory available at start), or by
default 90 % of the GPU, or on the CPU 4 GiB capped at half the available memory (vLLM's CPU
backend also defaults to 4 GiB). The slots are min(--max-batch-size, budget / slot bytes); a
budget that cannot hold one full-length sequence is refused before any weight is read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from dtmega.kernels.errors import DtmegaError

GiB = 2**30
CPU_DEFAULT_BYTES = 4 * GiB
GPU_DEFAULT_UTILIZATION = 0.9
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '2.5GB' or a plain number of bytes -> bytes (ValueError naming the flag)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise DtmegaError(f"--kv-cache-memory {text!r} is not a size. Fix: bytes, or a number with a unit "
                         "(e.g. 4GiB, 512MiB, 2GB)")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value >= 2**63:  # matrix 3, K2: 1e400 was a raw OverflowError
        raise DtmegaError(f"--kv-cache-memory {text!r} is not a size a machine has. Fix: bytes, or a number with a "
                          "unit (e.g. 4GiB, 512MiB, 2GB)")
    return int(value)


def kv_bytes_per_token(config, tp: int, dtype: torch.dtype) -> int:
    """Bytes one position's cache takes on one rank, over every block: keys and values, 2 x this
    rank's KV heads x head dim x element size; for multi-latent attention (DeepSeek) the latent
    and the rotary key, shared by every head and so whole on each tensor-parallel rank."""
    element = torch.tensor([], dtype=dtype).element_size()
    if hasattr(config, "kv_cache_bytes_per_token"):  # MLA
        return config.n_layers * config.kv_cache_bytes_per_token(element)
    return 2 * config.n_layers * (config.n_kv_heads // tp) * config.head_dim * element


def describe_kv_cache(config, tp: int, dtype: torch.dtype) -> str:
    """One line on what a cached position costs: its bytes on a rank, and for MLA what caching
    keys and values per head would cost instead (the latent cache's point)."""
    per_token = kv_bytes_per_token(config, tp, dtype)
    line = f"KV cache: {per_token:,} bytes per token on each rank"
    if hasattr(config, "mha_cache_bytes_per_token"):
        element = torch.tensor([], dtype=dtype).element_size()
        per_head = config.n_layers * config.mha_cache_bytes_per_token(element) // tp
        line += (f" (multi-latent attention: the latent and the rotary key; per-head keys and values would take "
                 f"{per_head:,}, {per_head / per_token:.1f}x)")
    return line


def weight_bytes(config, tp: int, dtype: torch.dtype) -> int:
    """About what this rank's share of the weights takes (every parameter split tp-ways)."""
    return math.ceil(config.num_params() / tp) * torch.tensor([], dtype=dtype).element_size()


def _available_host_bytes() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _device_total_bytes(device_type: str) -> int | None:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return _available_host_bytes()


@dataclass(frozen=True)
class KVBudget:
    """The bytes the cache may take on each rank, and where the number came from."""

    bytes: int
    source: str


def kv_budget(*, kv_cache_memory: str | None, utilization: float | None, device_type: str,
              weights: int) -> KVBudget:
    """The per-rank budget from the flags (see the module docstring); `weights`: this rank's
    weight bytes, taken out of a utilization budget."""
    if kv_cache_memory is not None and utilization is not None:
        raise DtmegaError("--kv-cache-memory and --gpu-memory-utilization both size the KV cache. Fix: give one")
    if kv_cache_memory is not None:
        size = parse_bytes(kv_cache_memory)
        return KVBudget(size, f"--kv-cache-memory {kv_cache_memory}")
    if utilization is not None and not 0 < utilization <= 1:
        raise DtmegaError(f"--gpu-memory-utilization {utilization} must be a fraction in (0, 1]")
    total = _device_total_bytes(device_type)
    if utilization is None and device_type != "cuda":
        cap = total // 2 if total else CPU_DEFAULT_BYTES
        return KVBudget(min(CPU_DEFAULT_BYTES, cap), "the CPU default: 4 GiB, at most half the available memory")
    fraction = utilization if utilization is not None else GPU_DEFAULT_UTILIZATION
    if total is None:
        raise DtmegaError("--gpu-memory-utilization: this machine's memory could not be read. Fix: --kv-cache-memory")
    where = "the GPU's memory" if device_type == "cuda" else "the available host memory"
    return KVBudget(max(0, int(total * fraction) - weights),
                    f"{fraction:.0%} of {where} ({total / GiB:.1f} GiB) less {weights / GiB:.2f} GiB of weights")


@dataclass(frozen=True)
class KVCacheSize:
    """Slots x positions of the server's cache and what it takes on each rank."""

    slots: int
    max_len: int
    bytes_per_token: int

    @property
    def bytes(self) -> int:
        return self.slots * self.max_len * self.bytes_per_token

    def describe(self) -> str:
        return (f"KV cache: {self.slots} slot{'s' * (self.slots != 1)} x {self.max_len} positions = "
                f"{self.bytes / GiB:.2f} GiB per rank ({self.bytes_per_token:,} bytes per token)")


def check_fits_memory(size: KVCacheSize, device_type: str, weights: int, source: str) -> None:
    """Refuses a cache that, with the weights, exceeds the device's memory (the host's available
    memory on a CPU), before anything is loaded (matrix 3, K1: `--kv-cache-memory 1TiB` was a raw
    allocation error from the first step)."""
    total = _device_total_bytes(device_type)
    if total is not None and size.bytes + weights > total:
        where = "the GPU's memory" if device_type == "cuda" else "this machine's available memory"
        fit = max(1, (total - weights) // (size.max_len * size.bytes_per_token)) if total > weights else 0
        raise DtmegaError(f"{source}: {size.slots:,} slots x {size.max_len:,} positions = {size.bytes / GiB:,.1f} GiB "
                          f"of KV cache, with {weights / GiB:.2f} GiB of weights, more than {where} "
                          f"({total / GiB:.1f} GiB). Fix: a smaller --kv-cache-memory or --max-batch-size (about "
                          f"{fit:,} slots fit), or a shorter --max-model-len")


def size_kv_cache(*, budget: KVBudget, max_len: int, bytes_per_token: int, max_batch_size: int) -> KVCacheSize:
    """As many slots as the budget holds (at most `max_batch_size`); ValueError naming the fix
    if it cannot hold one sequence of `max_len` positions."""
    per_slot = max_len * bytes_per_token
    slots = min(max_batch_size, budget.bytes // per_slot)
    if slots < 1:
        raise DtmegaError(
            f"the KV cache budget ({budget.bytes / GiB:.3f} GiB per rank, {budget.source}) cannot hold one "
            f"sequence of {max_len} positions ({per_slot / GiB:.3f} GiB at {bytes_per_token:,} bytes per token). "
            f"Fix: --kv-cache-memory {math.ceil(per_slot / 2**20)}MiB or more, or a shorter --max-model-len "
            f"(at most {budget.bytes // bytes_per_token} positions fit)")
    return KVCacheSize(int(slots), max_len, bytes_per_token)
