"""The per-block attention kernels ring attention is built from: the fused CPU kernel and the
plain-PyTorch reference against autograd through SDPA, and which part of a block is visible."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtmega.kernels.attention_blocks import block_attention, block_attention_backward, visible_block
from dtmega.kernels.context_shards import token_indices
from tests.helpers import relative_error


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_block_kernels_match_sdpa(fused, causal):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 24, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 4, 24, 16, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(2, 8, 24, 16, generator=g)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    expected.backward(dout)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 16**-0.5
    if causal:
        scores = scores.masked_fill(torch.ones(24, 24, dtype=torch.bool).triu(1), float("-inf"))
    with torch.no_grad():
        out, lse = block_attention(q, k, v, causal, 16**-0.5, fused)
        grads = block_attention_backward(dout, q, k, v, out, lse, causal, 16**-0.5, fused)
    # fp32: the fused flash kernel and SDPA's math differ only in summation order (~1e-7).
    assert relative_error(out, expected) < 1e-6
    assert relative_error(lse, torch.logsumexp(scores, -1)) < 1e-6
    for mine, reference in zip(grads, (q.grad, k.grad, v.grad)):
        assert mine.shape == reference.shape and relative_error(mine, reference) < 1e-5


def test_zigzag_blocks_are_half_visible_and_unmasked():
    world, seq = 4, 32
    positions = [token_indices(seq, world, r, zigzag=True) for r in range(world)]
    for rank in range(world):
        assert visible_block(positions[rank], positions[rank], causal=True) == (0, 8, True)
        for owner in range(world):
            if owner < rank:  # the owner's first chunk is before both of ours: all rows, half the keys
                assert visible_block(positions[rank], positions[owner], True) == (0, 4, False)
            elif owner > rank:  # only our second chunk sees theirs, all of it
                assert visible_block(positions[rank], positions[owner], True) == (4, 8, False)
    assert visible_block(positions[1], positions[2], causal=False) == (0, 8, False)
    contiguous = [token_indices(seq, world, r, zigzag=False) for r in range(world)]
    assert visible_block(contiguous[1], contiguous[2], causal=True) is None
    assert visible_block(contiguous[2], contiguous[1], causal=True) == (0, 8, False)
