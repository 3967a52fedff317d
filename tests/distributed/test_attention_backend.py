"""The attention kernel as a plan decision under the plans (issue 36): with each kernel this
CPU trains with forced (`flash`, `math`; FlexAttention has no CPU backward), training equals the unsharded model (loss, every
gradient, 5 AdamW steps; fp32 at the suite's 1e-5) under TP2+SP, FSDP2 and PP2; under CP2 the
context-parallel attention keeps its own kernel (the plan says so) and still equals it; and a
choice made by a fake timer on every rank lands in every rank's layout alike."""

from __future__ import annotations

import pytest

import dtmega
from dtmega.passes import (
    AttentionBackend,
    ContextParallel,
    DataParallel,
    PipelineSplit,
    SequenceParallel,
    TensorParallel,
)
from tests.helpers import assert_close_to_reference, build_dtmega_llama, compare_training, debug_llama, first_copy_mesh

PLANS = {
    "tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel()]),
    "fsdp2": (dict(dp_shard=2), [DataParallel("fsdp")]),
    "pp2": (dict(pp=2), [PipelineSplit(microbatches=2), DataParallel("ddp")]),
    "cp2": (dict(cp=2), [ContextParallel(method="all_gather"), DataParallel("fsdp")]),
}
CASES = [("tp2_sp", "flash"), ("fsdp2", "math"), ("pp2", "flash"), ("cp2", "math")]


@pytest.mark.parametrize("plan_name, backend", CASES, ids=[f"{p}-{b}" for p, b in CASES])
def test_a_forced_attention_kernel_trains_as_the_unsharded_model(plan_name, backend):
    sizes, passes = PLANS[plan_name]
    reference, meta_copy = build_dtmega_llama(debug_llama(), seed=61)
    data = [p for p in passes if isinstance(p, DataParallel)]  # DataParallel wraps what the others built: last
    plan = dtmega.Plan([*[p for p in passes if p not in data], AttentionBackend(backend), *data])
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(**sizes), plan)
    pm.init_weights(seed=61)
    kernels = {entry.kernel for fqn, entry in pm.layout.modules.items() if fqn.endswith("attention.core")}
    expected = {"attention.flex" if backend == "flex" else f"attention.sdpa.{backend}"}
    assert kernels == ({"attention.context_parallel.all_gather"} if plan_name == "cp2" else expected)
    assert_close_to_reference(compare_training(reference, pm, steps=5, seq_len=16))


def test_a_measured_choice_is_every_ranks(tmp_path_factory):
    """Each rank measures (a fake timer here, the device on a GPU); ties within 3 % go to the
    preferred kernel, so ranks whose times differ a little still agree."""
    import torch.distributed as dist

    rank = dist.get_rank()
    times = {"flash": 1.0e-3 * (1 + 0.01 * rank), "cudnn": 1.01e-3, "efficient": 3e-3, "flex": 4e-3, "math": 9e-3}
    cache = tmp_path_factory.mktemp(f"rank{rank}") / "choices.json"  # each rank its own file: each measures
    _, meta_copy = build_dtmega_llama(debug_llama(), seed=62)
    layout = dtmega.check_plan(meta_copy(), {"dp_shard": 4}, dtmega.Plan([
        AttentionBackend("auto", timer=times.__getitem__, cache=str(cache)), DataParallel("fsdp")]),
        workload=dtmega.passes.Workload(seq_len=16, micro_batch=2))
    chosen = [layout[fqn].kernel for fqn in layout.modules if fqn.endswith("attention.core")]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, chosen)
    assert all(choice == everyone[0] for choice in everyone) and set(everyone[0]) == {"attention.sdpa.flash"}
