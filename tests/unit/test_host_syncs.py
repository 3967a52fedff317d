"""The host-synchronization detector (dtmega/host_syncs.py) finds what makes the host wait, and
says where; FP8 delayed scaling's step on one rank has none (under the plans:
tests/distributed/test_fp8_host_syncs.py)."""

from __future__ import annotations

import pytest
import torch

import dtmega
from dtmega.host_syncs import HostSyncs, syncs_of
from dtmega.passes import Float8, Plan
from tests.helpers import build_dtmega_llama, debug_llama


@pytest.mark.parametrize("read, op", [
    (lambda t: t.sum().item(), "aten._local_scalar_dense"),
    (lambda t: float(t.max()), "aten._local_scalar_dense"),
    (lambda t: bool(t.any()), "aten._local_scalar_dense"),
    (lambda t: t[t > 0], "aten.index"),
    (lambda t: torch.nonzero(t), "aten.nonzero"),
    (lambda t: torch.equal(t, t), "aten.equal"),
], ids=["item", "float", "bool", "mask", "nonzero", "equal"])
def test_each_kind_of_host_read_is_found(read, op):
    found = syncs_of(read, torch.randn(8))
    assert [s.op for s in found][:1] == [op]


def test_device_side_ops_are_not_syncs_and_dtmega_frames_are_named():
    t = torch.randn(8)
    assert syncs_of(lambda: (t * 2).amax().clamp(min=1).sqrt()) == []
    from dtmega.train.optim import global_grad_norm

    parameter = torch.nn.Parameter(torch.randn(4))
    parameter.grad = torch.randn(4)
    found = syncs_of(global_grad_norm, [parameter])
    assert found and found[0].where.startswith("dtmega/train/optim.py:") and found[0].where.endswith("global_grad_norm")


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_an_fp8_step_makes_the_host_wait_nowhere(recipe):
    """Forward, backward and the after-step update (delayed: the amax reduction, history roll and
    new scales) on the device only, from the first step (current scaling) on."""
    _, meta_copy = build_dtmega_llama(debug_llama(n_layers=2), seed=9)
    plan = Plan([Float8(recipe=recipe, amax_history_len=4, min_features=16)])
    pm = dtmega.parallelize(meta_copy(), dtmega.make_mesh(device_type="cpu"), plan)
    pm.init_weights(seed=9)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    for step in range(3):
        optimizer.zero_grad()
        fields, context, tokens = pm.begin_step(dtmega.synthetic_batch(4, 16, 256, seed=step))  # host side: the batch
        with HostSyncs() as recorder:
            pm.run_step(fields, context, tokens)
        optimizer.step()
        with HostSyncs() as after:
            pm.after_optimizer_step()
        assert recorder.found + after.found == [], (recorder.describe(), after.describe())
