"""Which tokens of a sequence each context-parallel rank holds, and a counter of what
context-parallel attention does: the bytes it sends and the blocks it attends or skips."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CommStats:
    """Bytes this rank sent for context-parallel attention (forward and backward), and the
    (query shard x key shard) blocks its forward attended or skipped as fully masked, with the
    query-key pairs attended per sample."""

    bytes_sent: int = 0
    blocks_attended: int = 0
    blocks_skipped: int = 0
    pairs_attended: int = 0

    def add(self, tensor: torch.Tensor, copies: int = 1) -> None:
        """Counts `copies` sends of `tensor`."""
        self.bytes_sent += tensor.numel() * tensor.element_size() * copies

    def count_block(self, parts) -> None:
        """Counts one block of a forward with its parts (kernels/context_blocks.BlockPart)."""
        if parts:
            self.blocks_attended += 1
            self.pairs_attended += sum(part.pairs for part in parts)
        else:
            self.blocks_skipped += 1


def token_indices(seq_len: int, world: int, rank: int, zigzag: bool, device=None) -> torch.Tensor:
    """Global positions (ascending) of the `seq_len // world` tokens `rank` holds: a contiguous
    chunk, or with zigzag the chunks `rank` and `2*world-1-rank` of 2*world, so that every rank
    has the same causal work."""
    if not zigzag:
        chunk = seq_len // world
        return torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    chunk = seq_len // (2 * world)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    mirror = 2 * world - 1 - rank
    return torch.cat([first, torch.arange(mirror * chunk, (mirror + 1) * chunk, device=device)])
