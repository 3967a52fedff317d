"""The context-parallel attention op alone against full attention: cp=2 and cp=4, every method,
causal and full masks, GQA, contiguous and zigzag shards; outputs and dQ/dK/dV (fp32: 1e-5;
bf16 inputs against fp32 attention of the same bf16 values: 1e-2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtmega.kernels import CommStats, context_parallel_attention, token_indices
from tests.helpers import first_copy_mesh, relative_error


def reference(q, k, v, causal):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", ["ring", "all_gather", "a2a"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("zigzag", [True, False], ids=["zigzag", "contiguous"])
def test_matches_full_attention(cp, method, causal, zigzag):
    check(cp, method, causal, zigzag, torch.float32, tolerance=1e-5)


@pytest.mark.parametrize("method", ["ring", "all_gather", "a2a"])
def test_bf16_matches_full_attention(method):
    # Outputs and gradients are rounded to bf16 (u = 2**-8 ~ 3.9e-3), blocks merged in another
    # order than one fp32 softmax: a few u, 1e-2 ~ 2.5u (fp32 runs of the same op: 1e-5).
    check(4, method, True, True, torch.bfloat16, tolerance=1e-2)


@pytest.mark.parametrize("method", ["ring", "all_gather"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("zigzag", [True, False], ids=["zigzag", "contiguous"])
def test_blockwise_methods_with_the_reference_block_kernel(method, causal, zigzag):
    """The plain-PyTorch block kernel (what non-CPU devices run) through the whole method."""
    check(4, method, causal, zigzag, torch.float32, tolerance=1e-5, fused=False)


def check(cp, method, causal, zigzag, dtype, tolerance, fused=None):
    group = first_copy_mesh(cp=cp)["cp"].get_group()
    rank = torch.distributed.get_rank(group)
    g = torch.Generator().manual_seed(7)
    batch, seq, heads, kv_heads, dim = 2, 32, 8, 4, 16
    inputs = [torch.randn(batch, seq, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads)]
    dout = torch.randn(batch, seq, heads, dim, generator=g).to(dtype)
    q, k, v = (t.detach().float().requires_grad_() for t in inputs)
    expected = reference(q, k, v, causal)
    expected.backward(dout.float())
    idx = token_indices(seq, cp, rank, zigzag)
    local = [t[:, idx].detach().clone().requires_grad_() for t in inputs]
    stats = CommStats()
    out = context_parallel_attention(*local, group=group, method=method, zigzag=zigzag, causal=causal, stats=stats,
                                     fused=fused)
    out.backward(dout[:, idx])
    assert out.dtype == dtype and all(t.grad.dtype == dtype for t in local)
    assert relative_error(out, expected[:, idx]) < tolerance
    for mine, full in zip(local, (q, k, v)):
        assert relative_error(mine.grad, full.grad[:, idx]) < tolerance
    assert stats.bytes_sent > 0
