"""A KV cache of fixed slots, one sequence each, every slot at its own length: what a server
needs to decode many requests together while they join and leave the batch.

`KVCache` (kv_cache.py) shares one position among all rows, so a batch must start and advance
together. Here each forward names the slots its rows belong to (`select`); every row writes its
keys and values at its own length and attends to its own past only (`CoreAttention` gets the
rows' lengths as a tensor `q_offset`). The model code is the same: `Llama.forward(tokens,
position_ids=cache.positions(seq), cache=cache)`.
"""

from __future__ import annotations

import torch

from dtmega.kernels.errors import DtmegaError


class SlotLayerCache:
    """One block's keys and values, [slots, max_len, kv_heads, head_dim] (or whatever a block
    caches per position: MLA's latent and rotary key, each its own shape), allocated on first
    use with the shapes the block produces (under tensor parallelism: this rank's heads only)."""

    def __init__(self, owner: "SlotKVCache"):
        self.owner = owner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores k, v [B, S, H, D] of the selected slots at their lengths; returns those slots'
        keys and values [B, L, H, D] up to the longest row's new length (positions past a row's
        own length are masked by the attention)."""
        owner = self.owner
        if self.keys is None:
            self.keys = k.new_zeros((owner.slots, owner.max_len, *k.shape[2:]))
            self.values = v.new_zeros((owner.slots, owner.max_len, *v.shape[2:]))
        rows = owner.active[:, None]
        positions = owner.length[:, None] + torch.arange(k.shape[1], device=k.device)
        self.keys[rows, positions] = k
        self.values[rows, positions] = v
        end = owner.longest + k.shape[1]
        return self.keys[owner.active, :end], self.values[owner.active, :end]


class SlotKVCache:
    """Every block's cache, the length of each slot, and the slots of the current forward."""

    def __init__(self, slots: int, max_len: int, device: torch.device | str = "cpu"):
        self.slots, self.max_len = slots, max_len
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self.active = torch.zeros(0, dtype=torch.long, device=device)
        self.longest = 0
        self.layers: dict[str, SlotLayerCache] = {}

    def select(self, slots: list[int], new_tokens: int) -> None:
        """The rows of the next forward are these slots, each adding `new_tokens` positions;
        refuses a row that would outgrow the cache (before any block writes)."""
        self.active = torch.tensor(slots, dtype=torch.long, device=self.lengths.device)
        lengths = [int(n) for n in self.lengths[self.active].tolist()]
        self.longest = max(lengths, default=0)
        if self.longest + new_tokens > self.max_len:
            raise DtmegaError(f"KV cache slots hold {self.max_len} positions; {self.longest + new_tokens} were asked for")

    @property
    def length(self) -> torch.Tensor:
        """Positions already filled in each selected slot [B] (the attention's `q_offset`)."""
        return self.lengths[self.active]

    def positions(self, new_tokens: int) -> torch.Tensor:
        """Position ids [B, new_tokens] of the next forward's tokens: each row continues its slot."""
        return self.length[:, None] + torch.arange(new_tokens, device=self.lengths.device)

    def layer(self, name: str) -> SlotLayerCache:
        """The cache of block `name`."""
        return self.layers.setdefault(name, SlotLayerCache(self))

    def advance(self, steps: int) -> None:
        """Marks `steps` more positions as filled in every selected slot (after every block)."""
        self.lengths[self.active] += steps

    def free(self, slot: int) -> None:
        """Empties a slot for the next sequence (its old keys are masked, then overwritten)."""
        self.lengths[slot] = 0
