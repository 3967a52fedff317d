"""RMSNorm and the fused residual-add + RMSNorm: the reference against torch's rms_norm, the
Triton kernels (under TRITON_INTERPRET=1) against the reference, forward and backward, and the
custom ops under torch.compile and DTensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from dtmega.kernels import rmsnorm
from dtmega.kernels.rmsnorm import rms_norm, rms_norm_residual
from dtmega.kernels.triton_support import LAUNCHES
from tests.helpers import relative_error

# fp32: the implementations differ from torch's composition only in summation order (~1e-7).
FP32_RTOL = 1e-5
# bf16: one rounding of the output (unit roundoff 2^-8 ~ 4e-3) where the compared path rounds
# at other points; a real error (a wrong scale, a missing term) is >= 1e-1.
BF16_RTOL = 1e-2
EPS = 1e-5
SHAPE = (3, 13, 40)  # odd token count (39 rows) and a dim that is not a power of two


def _inputs(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return {"x": make(*SHAPE), "residual": make(*SHAPE), "weight": 1 + 0.1 * make(SHAPE[-1]),
            "grad_y": make(*SHAPE), "grad_h": make(*SHAPE)}


def _run(fn, tensors: dict[str, torch.Tensor], names: list[str], grads: list[torch.Tensor]):
    """Outputs and the gradients of the named inputs for the given output gradients."""
    leaves = {k: v.clone().requires_grad_() for k, v in tensors.items() if k in names}
    outs = fn(**leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return [o.detach() for o in outs], list(torch.autograd.grad(outs, [leaves[k] for k in names], grads))


def _plain(x, weight):
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), EPS)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_torch_rms_norm(dtype):
    t = _inputs(dtype)
    tol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    names = ["x", "weight"]
    (y,), grads = _run(lambda x, weight: rms_norm(x, weight, EPS, impl="reference"), t, names, [t["grad_y"]])
    (y_ref,), grads_ref = _run(_plain, t, names, [t["grad_y"].float()])
    assert y.dtype == dtype and grads[0].dtype == dtype and grads[1].dtype == dtype
    if dtype == torch.float32:
        # The stated bound for the forward: the same operations as torch's rms_norm.
        assert relative_error(y, y_ref) < 1e-6
    assert relative_error(y, y_ref) < tol
    for mine, ref in zip(grads, grads_ref):
        assert relative_error(mine, ref) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_residual_reference_matches_add_then_rms_norm(dtype):
    t = _inputs(dtype, seed=1)
    tol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    names = ["x", "residual", "weight"]

    def unfused(x, residual, weight):
        h = x + residual
        return _plain(h, weight), h

    outs, grads = _run(lambda x, residual, weight: rms_norm_residual(x, residual, weight, EPS, impl="reference"),
                       t, names, [t["grad_y"], t["grad_h"]])
    outs_ref, grads_ref = _run(unfused, t, names, [t["grad_y"].float(), t["grad_h"]])
    assert torch.equal(outs[1], outs_ref[1])  # h is the same add, rounded the same way
    assert relative_error(outs[0], outs_ref[0]) < tol
    for mine, ref in zip(grads, grads_ref):
        assert relative_error(mine, ref) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused_residual", [False, True], ids=["plain", "residual"])
def test_triton_matches_reference(interpret, dtype, fused_residual):
    if not interpret:
        return  # ran in a fresh interpreter process (see the fixture)
    t = _inputs(dtype, seed=2)
    tol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    if fused_residual:
        names, grads_in = ["x", "residual", "weight"], [t["grad_y"], t["grad_h"]]

        def fn(impl):
            return lambda x, residual, weight: rms_norm_residual(x, residual, weight, EPS, impl=impl)
    else:
        names, grads_in = ["x", "weight"], [t["grad_y"]]

        def fn(impl):
            return lambda x, weight: rms_norm(x, weight, EPS, impl=impl)
    before = LAUNCHES.copy()
    outs, grads = _run(fn("triton"), t, names, grads_in)
    assert LAUNCHES["rms_norm_forward"] > before["rms_norm_forward"]
    assert LAUNCHES["rms_norm_backward"] > before["rms_norm_backward"]
    # The kernels were built for the interpreter, not compiled for a GPU.
    assert all(type(k).__name__ == "InterpretedFunction" for k in rmsnorm._kernels())
    outs_ref, grads_ref = _run(fn("reference"), t, names, grads_in)
    for mine, ref in zip(outs + grads, outs_ref + grads_ref):
        assert mine.dtype == ref.dtype and mine.shape == ref.shape
        assert relative_error(mine, ref) < tol


def test_auto_picks_reference_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t = _inputs(torch.float32)
    before = LAUNCHES.copy()
    rms_norm(t["x"], t["weight"], EPS)
    assert LAUNCHES == before
    with pytest.raises(ValueError, match="impl must be one of"):
        rms_norm(t["x"], t["weight"], EPS, impl="cuda")


def test_compiles_as_opaque_ops():
    t = _inputs(torch.float32, seed=3)

    def fn(x, residual, weight):
        y, h = rms_norm_residual(x, residual, weight, EPS)
        return rms_norm(y, weight, EPS).sum() + (h * h).sum()

    names = ["x", "residual", "weight"]
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    (out,), grads = _run(compiled, t, names, [torch.tensor(1.0)])
    (ref,), grads_ref = _run(fn, t, names, [torch.tensor(1.0)])
    # fp32, same kernels: any difference is summation order.
    assert relative_error(out, ref) < FP32_RTOL
    for mine, expected in zip(grads, grads_ref):
        assert relative_error(mine, expected) < FP32_RTOL


def test_dtensor_shard1_runs_locally(one_rank_mesh):
    t = _inputs(torch.float32, seed=4)
    mesh = one_rank_mesh
    x = distribute_tensor(t["x"], mesh, [Shard(1)]).requires_grad_()
    residual = distribute_tensor(t["residual"], mesh, [Shard(1)]).requires_grad_()
    weight = distribute_tensor(t["weight"], mesh, [Replicate()]).requires_grad_()
    grad_y, grad_h = (distribute_tensor(t[k], mesh, [Shard(1)]) for k in ("grad_y", "grad_h"))

    y, rstd = torch.ops.dtmega.rms_norm(x, weight, EPS, "reference")
    assert isinstance(y, DTensor) and y.placements == (Shard(1),) and rstd.placements == (Shard(1),)
    grad_x, grad_w = torch.ops.dtmega.rms_norm_backward(grad_y, None, x, weight, rstd, "reference")
    assert grad_x.placements == (Shard(1),) and grad_w.placements == (Partial(),)

    y, h = rms_norm_residual(x, residual, weight, EPS)
    assert y.placements == (Shard(1),) and h.placements == (Shard(1),)
    torch.autograd.backward([y, h], [grad_y, grad_h])
    assert x.grad.placements == (Shard(1),) and residual.grad.placements == (Shard(1),)

    names = ["x", "residual", "weight"]
    outs_ref, grads_ref = _run(lambda x, residual, weight: rms_norm_residual(x, residual, weight, EPS), t, names,
                               [t["grad_y"], t["grad_h"]])
    # fp32, the same kernels on the same (single) shard: equal up to summation order.
    for mine, ref in zip([y, h, x.grad, residual.grad, weight.grad], outs_ref + grads_ref):
        assert relative_error(mine.full_tensor(), ref) < FP32_RTOL
