"""Keys and values of past positions, for incremental decoding."""

from __future__ import annotations

import torch

from dtmega.kernels.errors import DtmegaError


def decoding_families() -> list[str]:
    """The registered model families whose blocks fill a KVCache (generation, `dtmega serve`):
    `Family.kv_cache` (the Llama's and Qwen3's keys and values per KV head, DeepSeek's MLA latent
    and rotary key, the GPT family's keys and values)."""
    from dtmega.models.family import model_families

    return [family.name for family in model_families() if family.kv_cache]


class LayerCache:
    """One block's keys and values, [B, max_len, kv_heads, head_dim] (or whatever a block caches
    per position: MLA's latent and rotary key), filled front to back.

    Allocated on first use with the shapes the block produces, so under tensor parallelism
    each rank caches only its own heads.
    """

    def __init__(self, owner: "KVCache"):
        self.owner = owner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores k, v [B, S, H, D] at the cache's current position; returns all keys/values so far."""
        start, length = self.owner.length, k.shape[1]
        if start + length > self.owner.max_len:
            raise DtmegaError(f"KV cache holds {self.owner.max_len} positions; {start + length} were asked for")
        if self.keys is None:  # each its own shape: MLA caches a latent and a rotary key here
            self.keys = k.new_zeros((k.shape[0], self.owner.max_len, *k.shape[2:]))
            self.values = v.new_zeros((v.shape[0], self.owner.max_len, *v.shape[2:]))
        self.keys[:, start:start + length] = k
        self.values[:, start:start + length] = v
        return self.keys[:, :start + length], self.values[:, :start + length]


class KVCache:
    """Every block's cache plus the shared position; `Llama.forward(..., cache=cache)` fills it."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0
        self.layers: dict[str, LayerCache] = {}

    def layer(self, name: str) -> LayerCache:
        """The cache of block `name`."""
        return self.layers.setdefault(name, LayerCache(self))

    def advance(self, steps: int) -> None:
        """Marks `steps` more positions as filled (after every block has stored them)."""
        self.length += steps
