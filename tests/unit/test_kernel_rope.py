"""RoPE on q and k in one op: the reference against dtmega.models.rope.apply_rope, the Triton
kernel (under TRITON_INTERPRET=1) against the reference, forward and backward, with GQA head
counts, explicit positions and strided q/k views, and the custom ops under torch.compile and
DTensor."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dtmega.kernels.rope import apply_rope_qk
from dtmega.kernels.triton_support import LAUNCHES
from dtmega.models.llama.config import RopeScaling
from dtmega.models.rope import apply_rope, rope_cache
from tests.helpers import relative_error

# fp32: the same products and sums as apply_rope (at most a different rounding of sin's sign).
FP32_RTOL = 1e-5
# bf16: one rounding of the result (unit roundoff 2^-8 ~ 4e-3); a real error (a wrong angle,
# swapped pair) is >= 1e-1.
BF16_RTOL = 1e-2
B, S, HQ, HK, D, MAX_SEQ = 2, 13, 4, 2, 16, 64  # odd sequence length, GQA (4 query heads per 2 kv)


def _cache() -> torch.Tensor:
    return rope_cache(MAX_SEQ, D, 500000.0, RopeScaling(original_max_seq_len=32))


def _qk(dtype: torch.dtype, seed: int, strided: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k; `strided`: views of one fused qkv projection's output, as attention makes them."""
    g = torch.Generator().manual_seed(seed)
    if strided:
        qkv = torch.randn(B, S, (HQ + 2 * HK) * D, generator=g).to(dtype)
        q, k, _ = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
        return q.view(B, S, HQ, D), k.view(B, S, HK, D)
    return torch.randn(B, S, HQ, D, generator=g).to(dtype), torch.randn(B, S, HK, D, generator=g).to(dtype)


def _positions(seed: int) -> torch.Tensor:
    return torch.randint(0, MAX_SEQ, (B, S), generator=torch.Generator().manual_seed(seed))


def _forward_backward(fn, q, k, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    q_out, k_out = fn(q, k)
    grads = [torch.randn(t.shape, generator=g).to(t.dtype) for t in (q_out, k_out)]
    return [q_out.detach(), k_out.detach(), *torch.autograd.grad((q_out, k_out), (q, k), grads)]


def _model_rope(cache, position_ids):
    cos_sin = cache[:S].unsqueeze(0) if position_ids is None else cache[position_ids]
    return lambda q, k: (apply_rope(q, cos_sin), apply_rope(k, cos_sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_positions", [False, True], ids=["default_positions", "position_ids"])
def test_reference_matches_model_rope(dtype, with_positions):
    cache = _cache()
    positions = _positions(1) if with_positions else None
    q, k = _qk(dtype, seed=0, strided=True)
    mine = _forward_backward(lambda q, k: apply_rope_qk(q, k, cache, positions, impl="reference"), q, k, seed=2)
    expected = _forward_backward(_model_rope(cache, positions), q, k, seed=2)
    tol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    for m, e in zip(mine, expected):
        assert m.dtype == e.dtype and m.shape == e.shape and relative_error(m, e) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv_views"])
def test_triton_matches_reference(interpret, dtype, strided):
    if not interpret:
        return  # ran in a fresh interpreter process (see the fixture)
    cache = _cache()
    tol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    q, k = _qk(dtype, seed=3, strided=strided)
    for positions in (None, _positions(4)):
        before = LAUNCHES["rope_qk"]
        mine = _forward_backward(lambda q, k, p=positions: apply_rope_qk(q, k, cache, p, impl="triton"), q, k, seed=5)
        assert LAUNCHES["rope_qk"] == before + 2  # forward and backward
        expected = _forward_backward(
            lambda q, k, p=positions: apply_rope_qk(q, k, cache, p, impl="reference"), q, k, seed=5)
        for m, e in zip(mine, expected):
            assert m.dtype == e.dtype and m.shape == e.shape and relative_error(m, e) < tol


def test_compiles_as_opaque_ops():
    cache, positions = _cache(), _positions(6)
    q, k = _qk(torch.float32, seed=6)

    def fn(q, k):
        q_rot, k_rot = apply_rope_qk(q * 2, k, cache, positions)
        return q_rot + 1, k_rot

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    # fp32, same kernels: any difference is summation order.
    for mine, expected in zip(_forward_backward(compiled, q, k, seed=7), _forward_backward(fn, q, k, seed=7)):
        assert relative_error(mine, expected) < FP32_RTOL


def test_rejects_mismatched_cache():
    q, k = _qk(torch.float32, seed=8)
    with pytest.raises(ValueError, match="cache"):
        apply_rope_qk(q, k, rope_cache(MAX_SEQ, 2 * D, 10000.0, None))


def test_dtensor_sequence_and_head_sharding(one_rank_mesh):
    cache, positions = _cache(), _positions(9)
    q, k = _qk(torch.float32, seed=9)
    expected = apply_rope_qk(q, k, cache, positions)
    mesh = one_rank_mesh
    cache_dt = distribute_tensor(cache, mesh, [Replicate()])

    # Sequence sharding (context parallel), with the positions sharded alike: local.
    q_dt, k_dt = (distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in (q, k))
    pos_dt = distribute_tensor(positions, mesh, [Shard(1)])
    q_rot, k_rot = apply_rope_qk(q_dt, k_dt, cache_dt, pos_dt)
    assert isinstance(q_rot, DTensor) and q_rot.placements == (Shard(1),) and k_rot.placements == (Shard(1),)
    (q_rot.sum() + k_rot.sum()).backward()
    assert q_dt.grad.placements == (Shard(1),) and k_dt.grad.placements == (Shard(1),)
    # fp32, the same kernels on the same (single) shard.
    assert relative_error(q_rot.full_tensor(), expected[0]) < FP32_RTOL
    assert relative_error(k_rot.full_tensor(), expected[1]) < FP32_RTOL

    # Without positions a sequence shard would restart at 0: the rule does not keep Shard(1).
    q_dt, k_dt = (distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k))
    q_rot, _ = apply_rope_qk(q_dt, k_dt, cache_dt, None)
    assert q_rot.placements != (Shard(1),)
    assert relative_error(q_rot.full_tensor(), apply_rope_qk(q, k, cache)[0]) < FP32_RTOL

    # Head sharding (tensor parallel): local, positions replicated.
    q_dt, k_dt = (distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k))
    q_rot, k_rot = apply_rope_qk(q_dt, k_dt, cache_dt, distribute_tensor(positions, mesh, [Replicate()]))
    assert q_rot.placements == (Shard(2),) and k_rot.placements == (Shard(2),)
    assert relative_error(q_rot.full_tensor(), expected[0]) < FP32_RTOL
