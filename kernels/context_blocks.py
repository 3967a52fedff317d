"""Which parts of each (this rank's queries x one rank's keys) block blockwise context-parallel
attention (ring, all-gather) computes.

A part is a rectangle of query rows and key columns that is either fully visible or, on a
rank's own tokens, plainly causal: the only two masks the fused block kernel takes. A block
with no part is skipped (nothing computed, counted in `CommStats.blocks_skipped`).

- One causal sequence (`causal_blocks`): with zigzag or contiguous shards each block has at
  most one part (kernels/attention_blocks.visible_block).
- Packed documents (`document_blocks`): every rank's tokens in ascending positions (any
  assignment, e.g. kernels/document_shards.py's balanced one) and each token's document. A run
  of a rank's queries that are consecutive in the sample and in one document sees, of another
  rank's keys, exactly those of its document that come before the run (a contiguous range of
  that rank's rows, fully visible), and of its own rank's keys also itself (causal). Nothing
  else is computed, so a rank's work is exactly the query-key pairs its mask allows (up to the
  causal parts' diagonal tiles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtmega.kernels.attention_blocks import visible_block
from dtmega.kernels.context_shards import token_indices


@dataclass(frozen=True)
class BlockPart:
    """Query rows `rows` of samples `batch` against key columns `cols` of one block, fully
    visible or (`causal`) the plain causal mask on a square of a rank's own tokens."""

    batch: slice
    rows: slice
    cols: slice
    causal: bool

    @property
    def pairs(self) -> int:
        """Query-key pairs this part attends, per sample."""
        rows, cols = self.rows.stop - self.rows.start, self.cols.stop - self.cols.start
        return rows * (rows + 1) // 2 if self.causal else rows * cols


class ContextBlocks:
    """The parts of every (query rank, key rank) block; `parts(rank, owner)` is what `rank`
    computes with the keys `owner` holds."""

    def __init__(self, world: int, parts):
        self.world, self._parts = world, parts

    def parts(self, rank: int, owner: int) -> list[BlockPart]:
        """Parts `rank`'s queries attend in `owner`'s keys (empty: the block is skipped)."""
        return self._parts(rank, owner)

    def work(self, rank: int, batch: int = 1) -> int:
        """Query-key pairs `rank` attends over all blocks (for `batch` samples when a part covers
        every sample)."""
        total = 0
        for owner in range(self.world):
            for part in self.parts(rank, owner):
                samples = batch if part.batch.stop is None else part.batch.stop - part.batch.start
                total += part.pairs * samples
        return total


def causal_blocks(seq_len: int, world: int, zigzag: bool, causal: bool, device=None) -> ContextBlocks:
    """Blocks of one sequence (causal or full) sharded zigzag or contiguously."""
    positions = [token_indices(seq_len, world, rank, zigzag, device) for rank in range(world)]
    cache: dict[tuple[int, int], list[BlockPart]] = {}

    def parts(rank: int, owner: int) -> list[BlockPart]:
        if (rank, owner) not in cache:
            visible = visible_block(positions[rank], positions[owner], causal)
            cache[rank, owner] = [] if visible is None else [
                BlockPart(slice(None), slice(visible[0], len(positions[rank])), slice(0, visible[1]), visible[2])]
        return cache[rank, owner]

    return ContextBlocks(world, parts)


def _runs(positions: list[int], documents: list[int]) -> list[tuple[int, int]]:
    """Row ranges [start, end) of tokens consecutive in the sample and in one document."""
    runs, start = [], 0
    for row in range(1, len(positions) + 1):
        if row == len(positions) or positions[row] != positions[row - 1] + 1 or documents[row] != documents[row - 1]:
            runs.append((start, row))
            start = row
    return runs


def _bisect(values: list[int], target: int) -> int:
    """First index whose value is >= target (values ascending)."""
    low, high = 0, len(values)
    while low < high:
        middle = (low + high) // 2
        if values[middle] < target:
            low = middle + 1
        else:
            high = middle
    return low


def document_blocks(positions: torch.Tensor, documents: torch.Tensor) -> ContextBlocks:
    """Blocks of packed samples: `positions` [world, B, n] each rank's tokens (ascending per
    sample), `documents` [world, B, n] their document ids (ascending along the sample)."""
    world, batch = positions.shape[0], positions.shape[1]
    where = positions.tolist()
    which = documents.tolist()
    runs = [[_runs(where[rank][b], which[rank][b]) for b in range(batch)] for rank in range(world)]
    cache: dict[tuple[int, int], list[BlockPart]] = {}

    def parts(rank: int, owner: int) -> list[BlockPart]:
        if (rank, owner) in cache:
            return cache[rank, owner]
        found = []
        for b in range(batch):
            keys_at, keys_in = where[owner][b], which[owner][b]
            for start, end in runs[rank][b]:
                document, first = which[rank][b][start], where[rank][b][start]
                low = _bisect(keys_in, document)
                high = min(_bisect(keys_in, document + 1), _bisect(keys_at, first))
                if high > low:  # this document's keys before the run
                    found.append(BlockPart(slice(b, b + 1), slice(start, end), slice(low, high), False))
                if owner == rank:
                    found.append(BlockPart(slice(b, b + 1), slice(start, end), slice(start, end), True))
        cache[rank, owner] = found
        return found

    return ContextBlocks(world, parts)
