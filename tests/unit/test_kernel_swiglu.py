"""SwiGLU's gate silu(a) * b, separate and packed: the reference against F.silu(a) * b, the
Triton kernels (under TRITON_INTERPRET=1) against the reference, forward and backward, and the
custom ops under torch.compile and DTensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dtmega.kernels.swiglu import swiglu, swiglu_packed
from dtmega.kernels.triton_support import LAUNCHES
from tests.helpers import relative_error

# fp32: sigmoid and the products in another order than torch's silu (~1e-7).
FP32_RTOL = 1e-5
# bf16: one rounding of the result (unit roundoff 2^-8 ~ 4e-3) where F.silu(a) * b in bf16
# rounds twice; a real error (a wrong derivative term) is >= 1e-1.
BF16_RTOL = 1e-2
ROWS, H = 37, 24  # an odd token count


def _inputs(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ab = (2 * torch.randn(ROWS, 2 * H, generator=g)).to(dtype)  # wide enough to reach silu's tails
    grad = torch.randn(ROWS, H, generator=g).to(dtype)
    return ab, grad


def _forward_backward(fn, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad)]


def _cases(impl: str):
    """(name, fn, inputs-from-ab) for the separate and packed layouts."""
    return [
        ("separate", lambda a, b: swiglu(a, b, impl=impl),
         lambda ab: [ab[:, :H].contiguous(), ab[:, H:].contiguous()]),
        ("packed", lambda ab: swiglu_packed(ab, impl=impl), lambda ab: [ab]),
    ]


def _unfused(layout: str):
    if layout == "separate":
        return lambda a, b: F.silu(a.float()) * b.float()
    return lambda ab: F.silu(ab[:, :H].float()) * ab[:, H:].float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_silu_times_b(dtype):
    ab, grad = _inputs(dtype, seed=0)
    tol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    for layout, fn, split in _cases("reference"):
        mine = _forward_backward(fn, split(ab), grad)
        expected = _forward_backward(_unfused(layout), split(ab), grad.float())
        assert mine[0].dtype == dtype and mine[0].shape == (ROWS, H)
        for m, e in zip(mine, expected):
            assert m.shape == e.shape and relative_error(m, e) < tol, layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_reference(interpret, dtype):
    if not interpret:
        return  # ran in a fresh interpreter process (see the fixture)
    ab, grad = _inputs(dtype, seed=1)
    tol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    before = LAUNCHES.copy()
    for (layout, fn, split), (_, ref_fn, _) in zip(_cases("triton"), _cases("reference")):
        mine = _forward_backward(fn, split(ab), grad)
        expected = _forward_backward(ref_fn, split(ab), grad)
        for m, e in zip(mine, expected):
            assert m.dtype == e.dtype and m.shape == e.shape and relative_error(m, e) < tol, layout
    assert LAUNCHES["swiglu_forward"] == before["swiglu_forward"] + 2
    assert LAUNCHES["swiglu_backward"] == before["swiglu_backward"] + 2


def test_packed_needs_an_even_last_dim():
    with pytest.raises(ValueError, match="even last dim"):
        swiglu_packed(torch.randn(3, 5))


def test_compiles_as_opaque_ops():
    ab, grad = _inputs(torch.float32, seed=2)

    def fn(ab):
        return swiglu(ab[:, :H], ab[:, H:]) * 2 + swiglu_packed(ab)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    # fp32, same kernels: any difference is summation order.
    for mine, expected in zip(_forward_backward(compiled, [ab], grad), _forward_backward(fn, [ab], grad)):
        assert relative_error(mine, expected) < FP32_RTOL


def test_dtensor_shard1_runs_locally(one_rank_mesh):
    g = torch.Generator().manual_seed(3)
    ab = torch.randn(2, 7, 2 * H, generator=g)
    grad = torch.randn(2, 7, H, generator=g)
    ab_dt = distribute_tensor(ab, one_rank_mesh, [Shard(1)]).requires_grad_()
    grad_dt = distribute_tensor(grad, one_rank_mesh, [Shard(1)])
    a_dt = distribute_tensor(ab[..., :H].contiguous(), one_rank_mesh, [Shard(1)]).requires_grad_()
    b_dt = distribute_tensor(ab[..., H:].contiguous(), one_rank_mesh, [Shard(1)]).requires_grad_()
    packed = swiglu_packed(ab_dt)
    separate = swiglu(a_dt, b_dt)
    assert isinstance(packed, DTensor) and packed.placements == (Shard(1),) and separate.placements == (Shard(1),)
    packed.backward(grad_dt)
    separate.backward(grad_dt)
    assert ab_dt.grad.placements == (Shard(1),) and a_dt.grad.placements == (Shard(1),)
    expected = _forward_backward(lambda ab: swiglu_packed(ab), [ab], grad)
    # fp32, the same kernels on the same (single) shard.
    assert relative_error(packed.full_tensor(), expected[0]) < FP32_RTOL
    assert relative_error(separate.full_tensor(), expected[0]) < FP32_RTOL
    assert relative_error(ab_dt.grad.full_tensor(), expected[1]) < FP32_RTOL
    grad_ab = torch.cat([a_dt.grad.full_tensor(), b_dt.grad.full_tensor()], -1)
    assert relative_error(grad_ab, expected[1]) < FP32_RTOL
