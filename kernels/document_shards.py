"""Which tokens of a packed sample each context-parallel rank holds when attention is causal
within each document: document-aware load balancing.

A zigzag of the whole sequence balances one causal triangle; packed documents make many small
triangles, whose work (query-key pairs a query may see: its position in its document, plus one)
depends on where the documents fall. Here the sample is cut into `chunks_per_rank x cp` equal
chunks, each chunk's work is counted from the document lengths, and chunks are dealt to ranks
largest first, each to the least-loaded rank that still has room (every rank holds the same
number of tokens), then single swaps between the most and least loaded ranks improve the
largest load while they can. A rank's tokens stay in ascending order, which is all the
blockwise kernels need (kernels/context_blocks.py).

The ids that travel with the sharded tokens are each document's first position in the sample
(`document_starts`): equal ids are still one document, and the ids gathered from every rank give
back the documents' lengths, so every attention layer recomputes the same assignment without
another message.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from dtmega.kernels.errors import DtmegaError

MAX_CHUNKS_PER_RANK = 8


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] ids -> the same documents, each id the position where its document starts."""
    seq = document_ids.shape[1]
    index = torch.arange(seq, device=document_ids.device).expand(document_ids.shape)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values


def lengths_from_starts(starts: list[int], seq_len: int) -> list[int]:
    """Document lengths from their (distinct, ascending) start positions."""
    bounds = [*starts, seq_len]
    return [end - start for start, end in zip(bounds[:-1], bounds[1:])]


def token_work(lengths: list[int]) -> torch.Tensor:
    """[S] query-key pairs each query attends under per-document causal attention."""
    return torch.cat([torch.arange(1, length + 1, dtype=torch.long) for length in lengths])


def chunks_per_rank(seq_len: int, world: int) -> int:
    """How many equal chunks each rank holds: the most (up to 8) that divide the sample."""
    for count in range(MAX_CHUNKS_PER_RANK, 0, -1):
        if seq_len % (world * count) == 0:
            return count
    raise DtmegaError(f"a sample of {seq_len} tokens cannot be split over cp={world} ranks. Fix: a sample length "
                      f"that is a multiple of {world}")


def _deal(work: list[int], world: int, per_rank: int) -> list[list[int]]:
    """Chunks (by their work) to ranks, `per_rank` each: largest first to the least loaded
    rank with room, then improving swaps between the most and the least loaded rank."""
    ranks: list[list[int]] = [[] for _ in range(world)]
    loads = [0] * world
    heap = [(0, rank) for rank in range(world)]
    for chunk in sorted(range(len(work)), key=lambda c: (-work[c], c)):
        load, rank = heapq.heappop(heap)
        ranks[rank].append(chunk)
        loads[rank] = load + work[chunk]
        if len(ranks[rank]) < per_rank:
            heapq.heappush(heap, (loads[rank], rank))
    for _ in range(4 * len(work)):
        high, low = max(range(world), key=loads.__getitem__), min(range(world), key=loads.__getitem__)
        gap, best = loads[high] - loads[low], None
        for a in ranks[high]:
            for b in ranks[low]:
                moved = work[a] - work[b]
                if 0 < moved < gap and (best is None or abs(gap - 2 * moved) < abs(gap - 2 * best[2])):
                    best = (a, b, moved)
        if best is None:
            break
        a, b, moved = best
        ranks[high][ranks[high].index(a)], ranks[low][ranks[low].index(b)] = b, a
        loads[high], loads[low] = loads[high] - moved, loads[low] + moved
    return [sorted(chunks) for chunks in ranks]


@dataclass(frozen=True)
class DocumentShards:
    """One sample's tokens per rank ([world, S/cp] ascending positions) and the attention work
    (query-key pairs) each rank's queries do."""

    positions: torch.Tensor
    work: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        """The most loaded rank's work over the mean (1.0 = perfectly balanced)."""
        mean = sum(self.work) / len(self.work)
        return max(self.work) / mean if mean else 1.0


def shard_documents(lengths: list[int], world: int, balanced: bool = True) -> DocumentShards:
    """Token positions of a sample packing documents of `lengths` for each of `world` ranks:
    balanced by per-document causal work, or (`balanced=False`) contiguous equal chunks."""
    seq = sum(lengths)
    work = token_work(lengths)
    if not balanced:
        positions = torch.arange(seq).view(world, seq // world)
    else:
        per_rank = chunks_per_rank(seq, world)
        size = seq // (world * per_rank)
        chunk_work = work.view(-1, size).sum(dim=1).tolist()
        owners = _deal(chunk_work, world, per_rank)
        positions = torch.stack([torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])
                                 for chunks in owners])
    return DocumentShards(positions, tuple(int(work[row].sum()) for row in positions))


def shard_batch_documents(document_ids: torch.Tensor, world: int, balanced: bool = True) -> list[DocumentShards]:
    """`shard_documents` for every sample of a [B, S] batch of document ids."""
    starts = document_starts(document_ids.cpu())
    return [shard_documents(lengths_from_starts(torch.unique_consecutive(row).tolist(), row.numel()), world, balanced)
            for row in starts]
