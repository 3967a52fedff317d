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


def _built(config, sizes: dict, plan: list):
    _, meta_copy = build_dtmega_llama(config, seed=5)
    pm = dtmega.parallelize(meta_copy(), mesh(**sizes), dtmega.Plan(plan))
    pm.init_weights(seed=5)
    return pm


def _other_axes():
    from dtmega.models import LlamaConfig
    from dtmega.passes import ContextParallel, ExpertParallel

    return {
        "cp2_ddp2": (debug_llama(), dict(cp=2, dp_replicate=2), [ContextParallel(), DataParallel("ddp")], "cp"),
        "hsdp2x2": (debug_llama(), dict(dp_replicate=2, dp_shard=2), [DataParallel("hsdp")], "dp_replicate"),
        "ep2_ddp2": (LlamaConfig.from_name("debug-moe"), dict(ep=2, dp_replicate=2),
                     [ExpertParallel(), DataParallel("ddp")], "ep"),
    }


@pytest.mark.parametrize("case", ["cp2_ddp2", "hsdp2x2", "ep2_ddp2"])
def test_a_copy_changed_along_cp_ep_or_hsdp_replicas_is_named_on_every_rank(case):
    """docs/reliability.md, Replicas: the copies over CP ranks, EP ranks and HSDP's replicas are
    compared too (not only TP and DDP's): one changed entry on one rank of that axis is named,
    with the axes, by the same error on every rank."""
    config, sizes, plan, axis = _other_axes()[case]
    pm = _built(config, sizes, plan)
    assert check_replicas(pm) == len(list(pm.named_parameters()))
    name = next(n for n, _ in pm.named_parameters() if axis in replica_axes(pm, n))
    axes = " x ".join(replica_axes(pm, name))
    changed = dist.get_world_size() - 1  # the last rank: the far end of every axis
    param = dict(pm.named_parameters())[name]
    if dist.get_rank() == changed:
        with torch.no_grad():
            local = param.to_local() if isinstance(param, torch.distributed.tensor.DTensor) else param
            local.view(-1)[0] += 1e-6
    with pytest.raises(ReplicaMismatch, match=f"{name} over {axes}: ranks \\[") as caught:
        check_replicas(pm)
    message = str(caught.value)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, message)
    assert len(set(everyone)) == 1 and str(changed) in message.split("ranks [", 1)[1].split("]", 1)[0], message
