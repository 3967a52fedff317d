"""A bad plan fails the same way on every rank, before anything is materialized or
communicated, and the process group stays usable (no rank is left in a collective)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dtmega
from dtmega.models import Llama, LlamaConfig
from dtmega.passes import DataParallel, PlanError, SequenceParallel, TensorParallel
from tests.helpers import mesh as cached_mesh


@pytest.mark.parametrize(
    "config, sizes, passes",
    [
        (dict(n_kv_heads=2), dict(tp=4), [TensorParallel()]),
        (dict(vocab_size=254), dict(tp=4), [TensorParallel()]),
        ({}, dict(tp=2, dp_shard=2), [DataParallel(), TensorParallel()]),
        ({}, dict(tp=4), [SequenceParallel()]),
        ({}, dict(tp=2, dp_shard=2), [TensorParallel()]),
    ],
    ids=["kv_heads", "vocab", "order", "sp_without_tp", "unused_axis"],
)
def test_bad_plan_fails_identically_everywhere(config, sizes, passes):
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("debug", **config))
    originals = {name: p for name, p in model.named_parameters()}
    mesh = cached_mesh(**sizes)
    with pytest.raises(PlanError) as caught:
        dtmega.parallelize(model, mesh, dtmega.Plan(passes))
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, str(caught.value))
    assert len(set(messages)) == 1, messages
    assert all(p is originals[name] for name, p in model.named_parameters()), "a parameter was replaced"


def test_world_size_mismatch_is_caught_before_any_group_is_made():
    with pytest.raises(PlanError, match="has 8 ranks but the world has 4"):
        dtmega.make_mesh(tp=8, dp_shard=1, device_type="cpu")
    dist.barrier()
