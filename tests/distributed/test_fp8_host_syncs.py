"""FP8 delayed scaling makes the host wait nowhere in the step (issue 36), under TP2+SP and
FSDP2: forward, backward and the after-step update (the step's amaxes reduced in one
collective, histories rolled, next scales computed) run on the device only, the first step's
current scaling included. dtmega/host_syncs.py records every op that reads device data on the
host; the batch's validation (`begin_step`, host work by design) stays outside the check."""

from __future__ import annotations

import pytest
import torch

import dtmega
from dtmega.host_syncs import HostSyncs
from dtmega.passes import DataParallel, Float8, SequenceParallel, TensorParallel
from tests.helpers import build_dtmega_llama, debug_llama, first_copy_mesh

PLANS = {
    "tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel()]),
    "fsdp2": (dict(dp_shard=2), [DataParallel("fsdp")]),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_fp8_delayed_scaling_never_makes_the_host_wait(name):
    sizes, passes = PLANS[name]
    _, meta_copy = build_dtmega_llama(debug_llama(n_layers=2), seed=75)
    fp8 = Float8(recipe="delayed", amax_history_len=4, min_features=16)
    data = [p for p in passes if isinstance(p, DataParallel)]
    plan = dtmega.Plan([*[p for p in passes if p not in data], fp8, *data])
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(**sizes), plan)
    pm.init_weights(seed=75)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    for step in range(3):
        optimizer.zero_grad()
        fields, context, tokens = pm.begin_step(pm.shard_batch(dtmega.synthetic_batch(4, 16, 256, seed=step)))
        with HostSyncs() as recorder:
            pm.run_step(fields, context, tokens)
        optimizer.step()
        with HostSyncs() as after:
            pm.after_optimizer_step()
        found = recorder.found + after.found
        assert [s for s in found if "float8" in s.where] == [], recorder.describe()
        # Beyond FP8: torch's vocab-parallel embedding (RowwiseParallel's _MaskPartial) zeroes
        # the other ranks' token ids by boolean indexing, a host sync per step on a GPU
        others = {(s.op, s.where.split(" in ")[-1]) for s in found}
        assert others <= ({("aten.index_put_", "trunk")} if name == "tp2_sp" else set()), recorder.describe()
