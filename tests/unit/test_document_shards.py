"""Document-aware context parallelism in one process: the tokens each rank holds (balanced by
the query-key pairs their documents let them attend), and the block parts ring and all-gather
attention compute, simulated rank by rank and checked against dense document-masked SDPA
(forward and every gradient, fp32: 1e-5 relative, the suite's tolerance for reordered fp32
sums)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtmega.kernels.attention_blocks import attend, attend_backward
from dtmega.kernels.context_blocks import causal_blocks, document_blocks
from dtmega.kernels.context_shards import CommStats
from dtmega.kernels.document_attention import dense_document_mask, document_ids_from_lengths
from dtmega.kernels.document_shards import document_starts, shard_batch_documents, shard_documents, token_work
from tests.helpers import relative_error

# a one-token document, one as long as the sample, and mixes of short and long ones
SAMPLES = [[1, 9, 22, 32], [64], [5, 5, 6, 16, 3, 29], [40, 11, 1, 12]]
MIXED = [700, 3, 120, 1, 2000, 64, 311, 900, 5, 1, 4, 17, 250, 1300, 15, 500, 2000, 1, 8, 2000, 23, 2000]


@pytest.mark.parametrize("world", [2, 4])
def test_balanced_deal_keeps_each_ranks_work_within_ten_percent_of_the_mean(world):
    lengths = MIXED + [8192 * 2 - sum(MIXED)]
    balanced = shard_documents(lengths, world)
    contiguous = shard_documents(lengths, world, balanced=False)
    assert balanced.imbalance <= 1.10, balanced.work
    assert balanced.imbalance < contiguous.imbalance
    assert sum(balanced.work) == sum(contiguous.work) == int(token_work(lengths).sum())
    held = balanced.positions.flatten().sort().values
    assert torch.equal(held, torch.arange(sum(lengths)))  # every token once, same count per rank
    assert all(bool((row[1:] > row[:-1]).all()) for row in balanced.positions)  # ascending per rank


def test_one_document_is_balanced_like_zigzag():
    shards = shard_documents([4096], 4)
    assert shards.imbalance < 1.01, shards.work


def simulate(q, k, v, positions, documents, dout):
    """Every rank's ring/all-gather computation in one process: out and grads in sample order."""
    world = positions.shape[0]
    blocks = document_blocks(positions, documents)
    out, dq, dk, dv = (torch.zeros_like(t) for t in (q, q, k, v))
    rows = torch.arange(q.shape[0])[:, None]
    shard = [(q[rows, :, positions[r]].transpose(1, 2).contiguous(),
              torch.stack([k[rows, :, positions[r]].transpose(1, 2), v[rows, :, positions[r]].transpose(1, 2)]))
             for r in range(world)]
    stats = CommStats()
    for rank in range(world):
        q_r, kv_r = shard[rank]
        o, lse = attend(q_r, ((shard[owner][1], blocks.parts(rank, owner)) for owner in range(world)), 0.25, None,
                        stats)
        out[rows, :, positions[rank]] = o.transpose(1, 2)
        g = dout[rows, :, positions[rank]].transpose(1, 2).contiguous()
        dq_r = torch.zeros_like(q_r)
        for owner in range(world):
            dkv = torch.zeros_like(shard[owner][1])
            attend_backward(g, q_r, o, lse, shard[owner][1], blocks.parts(rank, owner), 0.25, None, dq_r, dkv)
            dk[rows, :, positions[owner]] += dkv[0].transpose(1, 2)
            dv[rows, :, positions[owner]] += dkv[1].transpose(1, 2)
        dq[rows, :, positions[rank]] = dq_r.transpose(1, 2)
    return out, dq, dk, dv, blocks, stats


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "contiguous"])
def test_document_block_parts_equal_dense_document_masked_attention(world, balanced):
    g = torch.Generator().manual_seed(world)
    ids = document_ids_from_lengths(SAMPLES, 64)
    q = torch.randn(4, 4, 64, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(4, 2, 64, 8, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(4, 4, 64, 8, generator=g)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(ids), scale=0.25, enable_gqa=True)
    expected.backward(dout)
    shards = shard_batch_documents(ids, world, balanced)
    positions = torch.stack([s.positions for s in shards], dim=1)
    starts = document_starts(ids)
    documents = torch.stack([starts[b, positions[:, b]] for b in range(4)], dim=1)
    with torch.no_grad():
        out, dq, dk, dv, blocks, stats = simulate(q, k, v, positions, documents, dout)
    for got, want in ((out, expected), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert relative_error(got, want) < 1e-5
    # work counted by the parts is exactly the mask's query-key pairs
    mask_pairs = int(dense_document_mask(ids).sum())
    assert sum(blocks.work(rank) for rank in range(world)) == mask_pairs == stats.pairs_attended
    for rank in range(world):
        assert blocks.work(rank) == sum(s.work[rank] for s in shards)


def test_fully_masked_blocks_are_skipped():
    """Samples of short documents: most (query rank x key rank) blocks share no document."""
    ids = document_ids_from_lengths([[4] * 16], 64)
    shards = shard_batch_documents(ids, 4, balanced=False)
    positions = torch.stack([s.positions for s in shards], dim=1)
    blocks = document_blocks(positions, document_starts(ids)[:, positions[:, 0]].permute(1, 0, 2))
    empty = [(r, o) for r in range(4) for o in range(4) if not blocks.parts(r, o)]
    assert len(empty) == 12  # only each rank's own block holds a document's keys
    causal = causal_blocks(64, 4, zigzag=False, causal=True)
    assert sum(not causal.parts(r, o) for r in range(4) for o in range(4)) == 6
