"""dtmega.replicas.check_replicas: the copies of every replicated parameter (over TP, DDP's
replicas, CP, EP) are compared by hash on every rank; one changed copy is named, with its axes and
rank, on every rank (no rank left waiting in a later collective)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dtmega
from dtmega.passes import DataParallel, SequenceParallel, TensorParallel
from dtmega.replicas import ReplicaMismatch, check_replicas, replica_axes
from tests.helpers import build_dtmega_llama, debug_llama, mesh


def _tp2_ddp2():
    _, meta_copy = build_dtmega_llama(debug_llama(), seed=5)
    pm = dtmega.parallelize(meta_copy(), mesh(tp=2, dp_replicate=2),
                            dtmega.Plan([TensorParallel(), SequenceParallel(), DataParallel("ddp")]))
    pm.init_weights(seed=5)
    return pm


def test_replicas_agree_after_init_and_the_axes_are_the_layouts():
    pm = _tp2_ddp2()
    assert check_replicas(pm) == len(list(pm.named_parameters()))
    assert replica_axes(pm, "norm.weight") == ("dp_replicate", "tp")
    assert replica_axes(pm, "layers.0.attention.wq.weight") == ("dp_replicate",)


@pytest.mark.parametrize("name, axes, changed_rank", [("norm.weight", "dp_replicate x tp", 1),
                                                      ("layers.1.attention.wq.weight", "dp_replicate", 3)])
def test_one_changed_copy_is_named_on_every_rank(name, axes, changed_rank):
    pm = _tp2_ddp2()
    param = dict(pm.named_parameters())[name]
    if dist.get_rank() == changed_rank:
        with torch.no_grad():
            local = param.to_local() if isinstance(param, torch.distributed.tensor.DTensor) else param
            local.view(-1)[0] += 1e-6  # one entry, far below anything a loss would show
    with pytest.raises(ReplicaMismatch, match=f"{name} over {axes}: ranks \\[{changed_rank}\\] differ"):
        check_replicas(pm)


@pytest.mark.parametrize("flags, checks", [(["--check-weight-hash-across-dp-replicas-interval", "2"], 3),
                                           (["--test-mode"], 5)])
def test_dtmega_train_checks_at_the_start_and_when_the_flags_say(flags, checks, corpus, monkeypatch):
    """4 steps on TP 2 x DP 2: the check runs at the start and at steps 2 and 4 (every 2), or after
    every step (--test-mode), and finds every copy equal (the run completes)."""
    import dtmega.train.replica_check as schedule
    from tests.train_helpers import tiny_args, train_reusing_meshes

    counted = []

    def counting(pm):
        counted.append(check_replicas(pm))
        return counted[-1]

    monkeypatch.setattr(schedule, "check_replicas", counting)
    result = train_reusing_meshes(tiny_args(corpus, train_iters=4, tensor_model_parallel_size=2, eval_iters=0) + flags)
    assert len(result.losses) == 4 and len(counted) == checks and all(counted)
