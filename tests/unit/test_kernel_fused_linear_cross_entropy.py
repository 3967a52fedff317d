"""The output projection fused with cross entropy: the chunked reference against the unfused
F.cross_entropy(h @ W.T), the Triton row kernels (under TRITON_INTERPRET=1) against the
reference, forward and backward, per token and weighted sum, with ignored tokens and z-loss;
torch.compile; what autograd saves; and vocab parallelism on two real gloo ranks."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from dtmega.kernels.fused_linear_cross_entropy import (
    CHUNK_LOGITS_BYTES,
    default_chunk_size,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_sum,
)
from dtmega.kernels.triton_support import LAUNCHES, triton_available
from tests.helpers import relative_error

# fp32: chunking, the online log-sum-exp and the per-chunk weight-gradient sums change only the
# summation order (~1e-7).
FP32_RTOL = 1e-5
# bf16: the logits and gradients are rounded to bf16 (unit roundoff 2^-8 ~ 4e-3) at other
# points than in the unfused path (e.g. grad_weight once per chunk); a real error (a missing
# z-loss term, a wrong token's gradient) is >= 1e-1.
BF16_RTOL = 1e-2
N, D, V, CHUNK = 37, 16, 50, 8  # an odd token count, a ragged last chunk
IGNORE = -100
Z_LOSS = 1e-3


def _data(dtype: torch.dtype, seed: int, vocab: int = V) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (N,), generator=g)
    labels[torch.rand(N, generator=g) < 0.25] = IGNORE  # a mask of ignored tokens
    return {
        "hidden": torch.randn(N, D, generator=g).to(dtype),
        "weight": torch.randn(vocab, D, generator=g).to(dtype),
        "labels": labels,
        "grad": torch.randn(N, generator=g),  # any per-token output gradient
        "token_weights": torch.rand(N, generator=g),
    }


def _unfused(hidden, weight, labels, z_loss):
    logits = (hidden @ weight.T).float()
    loss = F.cross_entropy(logits, labels, reduction="none", ignore_index=IGNORE)
    return loss + z_loss * torch.logsumexp(logits, -1).pow(2) * (labels != IGNORE)


def _per_token(fn, d, **kw) -> list[torch.Tensor]:
    """Losses and the gradients of hidden and weight for the output gradient d['grad']."""
    hidden, weight = d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_()
    loss = fn(hidden, weight, d["labels"], **kw)
    return [loss.detach(), *torch.autograd.grad(loss, (hidden, weight), d["grad"])]


def _summed(fn, d, **kw) -> list[torch.Tensor]:
    """The weighted sum (times 3, a non-unit output gradient) and its gradients."""
    hidden, weight = d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_()
    total = fn(hidden, weight, d["labels"], d["token_weights"], **kw)
    return [total.detach(), *torch.autograd.grad(3 * total, (hidden, weight))]


def _unfused_sum(hidden, weight, labels, token_weights, z_loss):
    return (_unfused(hidden, weight, labels, z_loss) * token_weights).sum()


def _assert_close(mine: list[torch.Tensor], expected: list[torch.Tensor], tol: float) -> None:
    for name, m, e in zip(("loss", "grad_hidden", "grad_weight"), mine, expected):
        assert m.shape == e.shape and m.dtype == e.dtype, name
        assert relative_error(m, e) < tol, f"{name}: {relative_error(m, e):.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("z_loss", [0.0, Z_LOSS], ids=["ce", "z_loss"])
def test_reference_matches_unfused(dtype, z_loss):
    d = _data(dtype, seed=0)
    tol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    opts = dict(chunk_size=CHUNK, z_loss=z_loss, impl="reference")
    mine = _per_token(fused_linear_cross_entropy, d, **opts)
    _assert_close(mine, _per_token(_unfused, d, z_loss=z_loss), tol)
    assert torch.all(mine[0][d["labels"] == IGNORE] == 0)
    _assert_close(_summed(fused_linear_cross_entropy_sum, d, **opts), _summed(_unfused_sum, d, z_loss=z_loss), tol)
    # One chunk (the default size at this vocab) gives the same.
    one_chunk = _per_token(fused_linear_cross_entropy, d, z_loss=z_loss, impl="reference")
    _assert_close(one_chunk, mine, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_reference(interpret, dtype):
    if not interpret:
        return  # ran in a fresh interpreter process (see the fixture)
    d = _data(dtype, seed=1)
    tol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    before = LAUNCHES.copy()
    for run, fn in ((_per_token, fused_linear_cross_entropy), (_summed, fused_linear_cross_entropy_sum)):
        mine = run(fn, d, chunk_size=CHUNK, z_loss=Z_LOSS, impl="triton")
        _assert_close(mine, run(fn, d, chunk_size=CHUNK, z_loss=Z_LOSS, impl="reference"), tol)
    chunks = -(-N // CHUNK)
    assert LAUNCHES["cross_entropy_forward"] == before["cross_entropy_forward"] + 2 * chunks
    assert LAUNCHES["cross_entropy_grad"] == before["cross_entropy_grad"] + chunks  # per-token backward


def test_default_chunk_size():
    assert CHUNK_LOGITS_BYTES == 256 * 2**20
    assert default_chunk_size(32000) == 2097  # 256 MiB / (4 B x 32000)
    assert default_chunk_size(128256) == 523
    assert default_chunk_size(2**40) == 1


def test_sum_without_grad_skips_gradients():
    d = _data(torch.float32, seed=2)
    with torch.no_grad():
        total = fused_linear_cross_entropy_sum(d["hidden"], d["weight"], d["labels"], d["token_weights"])
    expected = _unfused_sum(d["hidden"], d["weight"], d["labels"], d["token_weights"], 0.0)
    assert relative_error(total, expected) < FP32_RTOL


def test_compiles_as_opaque_ops():
    d = _data(torch.float32, seed=3)

    def fn(hidden, weight, labels, token_weights):
        per_token = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=CHUNK, z_loss=Z_LOSS)
        total = fused_linear_cross_entropy_sum(hidden, weight, labels, token_weights, chunk_size=CHUNK)
        return (per_token * token_weights).sum() + 2 * total

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    # fp32, same kernels: any difference is summation order.
    _assert_close(_summed(compiled, d), _summed(fn, d), FP32_RTOL)


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while running fn (a tensor saved by two
    nodes counts once)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(saved.values())


def test_saves_an_eighth_of_the_unfused_loss():
    # Meta tensors carry shapes and dtypes without data: autograd's bookkeeping at full size, free.
    tokens, vocab, dim = 4 * 2048, 32000, 256
    hidden = torch.empty(tokens, dim, device="meta", requires_grad=True)
    weight = torch.empty(vocab, dim, device="meta", requires_grad=True)
    labels = torch.empty(tokens, dtype=torch.int64, device="meta")
    token_weights = torch.empty(tokens, device="meta")
    unfused = _saved_bytes(lambda: F.cross_entropy((hidden @ weight.T).float(), labels, reduction="none"))
    per_token = _saved_bytes(lambda: fused_linear_cross_entropy(hidden, weight, labels))
    summed = _saved_bytes(lambda: fused_linear_cross_entropy_sum(hidden, weight, labels, token_weights))
    # The module docstring's closed forms (fp32: 4 bytes per element).
    assert unfused == 4 * (tokens + vocab) * dim + 4 * tokens * vocab + 8 * tokens + 4
    assert per_token == 4 * (tokens + vocab) * dim + 8 * tokens + 4 * tokens
    assert summed == 4 * (tokens + vocab) * dim
    assert per_token <= unfused / 8 and summed <= unfused / 8


def test_dtensor_token_sharding_runs_locally(one_rank_mesh):
    d = _data(torch.float32, seed=5)
    mesh = one_rank_mesh
    expected, expected_sum = _per_token(_unfused, d, z_loss=Z_LOSS), _summed(_unfused_sum, d, z_loss=Z_LOSS)
    labels, grad, token_weights = (
        distribute_tensor(d[k], mesh, [Shard(0)]) for k in ("labels", "grad", "token_weights"))
    for summed in (False, True):
        hidden = distribute_tensor(d["hidden"], mesh, [Shard(0)]).requires_grad_()
        weight = distribute_tensor(d["weight"], mesh, [Replicate()]).requires_grad_()
        if summed:
            out = fused_linear_cross_entropy_sum(
                hidden, weight, labels, token_weights, chunk_size=CHUNK, z_loss=Z_LOSS)
            assert isinstance(out, DTensor) and out.placements == (Partial(),)
            out = out.full_tensor()
            out.backward(torch.tensor(3.0))
        else:
            out = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=CHUNK, z_loss=Z_LOSS)
            assert isinstance(out, DTensor) and out.placements == (Shard(0),)
            out.backward(grad)
            out = out.full_tensor()
        assert hidden.grad.placements == (Shard(0),) and weight.grad.placements == (Partial(),)
        # fp32, the same kernels on the same (single) shard.
        mine = [out.detach(), hidden.grad.full_tensor(), weight.grad.full_tensor()]
        _assert_close(mine, expected_sum if summed else expected, FP32_RTOL)


# ---------------------------------------------------------------------------------------------
# Vocab parallel on two gloo ranks


def _vocab_parallel_worker(rank: int, world: int, init_file: str, impls: list[str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = DeviceMesh("cpu", list(range(world)))
        d = _data(torch.float32, seed=4, vocab=51)  # 51 rows: uneven shards (26 + 25)
        expected_per_token = _per_token(_unfused, d, z_loss=Z_LOSS)
        expected_sum = _summed(_unfused_sum, d, z_loss=Z_LOSS)
        cases = [(i, s, r) for i in impls for s in (False, True) for r in (True, False)]
        for impl, summed, replicated_dtensor in cases:
            case = f"rank {rank} impl={impl} summed={summed} hidden={'DTensor' if replicated_dtensor else 'plain'}"
            weight = distribute_tensor(d["weight"], mesh, [Shard(0)]).requires_grad_()
            if replicated_dtensor:  # sequence-parallel hidden states all-gathered before the head
                leaf = distribute_tensor(d["hidden"], mesh, [Shard(0)]).requires_grad_()
                hidden = leaf.redistribute(mesh, [Replicate()])
            else:
                leaf = hidden = d["hidden"].clone().requires_grad_()
            opts = dict(chunk_size=CHUNK, z_loss=Z_LOSS, impl=impl)
            if summed:
                out = fused_linear_cross_entropy_sum(hidden, weight, d["labels"], d["token_weights"], **opts)
                grad_out, expected = torch.tensor(3.0), expected_sum
            else:
                out = fused_linear_cross_entropy(hidden, weight, d["labels"], **opts)
                grad_out, expected = d["grad"], expected_per_token
            assert not isinstance(out, DTensor), case
            if replicated_dtensor:
                (grad_hidden,) = torch.autograd.grad(out, hidden, grad_out, retain_graph=True)
                assert grad_hidden.placements == (Partial(),), case
            out.backward(grad_out)
            assert weight.grad.placements == (Shard(0),), case
            grad_leaf = leaf.grad.full_tensor() if replicated_dtensor else leaf.grad
            # fp32: the vocab shards' partial sums are the only change of summation order.
            _assert_close([out.detach(), grad_leaf, weight.grad.full_tensor()], expected, FP32_RTOL)
    finally:
        dist.destroy_process_group()
    # Leave without Python's finalization: a background C++ thread still joinable at exit
    # aborts the process ("terminate called without an active exception") under load.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def test_vocab_parallel_matches_unsharded_on_two_ranks(monkeypatch, tmp_path):
    impls = ["reference"]
    if triton_available():  # the spawned ranks import triton after this, so it interprets there
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        impls.append("triton")
    mp.spawn(_vocab_parallel_worker, args=(2, str(tmp_path / "store"), impls), nprocs=2, join=True)
