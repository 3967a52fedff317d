"""One-rank runs (a world of one, created on demand): the empty plan, recompute that really
recomputes, and batch validation."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch.utils._python_dispatch import TorchDispatchMode

import dtmega
from dtmega.passes import Plan, Recompute
from tests.helpers import assert_close_to_reference, build_dtmega_llama, compare_training, debug_llama


def parallel_llama(passes, seed=0):
    reference, meta_copy = build_dtmega_llama(debug_llama(), seed=seed)
    pm = dtmega.parallelize(meta_copy(), dtmega.make_mesh(device_type="cpu"), Plan(passes))
    pm.init_weights(seed=seed)
    return reference, pm


@pytest.mark.parametrize("passes", [[], [Recompute("full")], [Recompute("selective")]], ids=["empty", "full", "selective"])
def test_one_rank_plans_match_unsharded(passes):
    reference, pm = parallel_llama(passes)
    assert_close_to_reference(compare_training(reference, pm, steps=5))


def _count_forwards(module: torch.nn.Module) -> list[int]:
    calls = [0]
    original = module.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    module.forward = counted
    return calls


def test_full_recompute_runs_the_block_again_in_backward():
    _, pm = parallel_llama([Recompute("full", every=2)])
    recomputed = _count_forwards(pm.module.get_submodule("layers.1"))
    skipped = _count_forwards(pm.module.get_submodule("layers.0"))
    pm.forward_backward(dtmega.synthetic_batch(2, 8, 256))
    assert recomputed[0] == 2 and skipped[0] == 1


class _CountAttention(TorchDispatchMode):
    """Counts attention forwards: the fused CPU flash forward of plain cores, and the recomputed
    cores' op, which runs one forward in forward and one more inside its backward."""

    FORWARDS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                torch.ops.dtmega.recomputed_attention.default, torch.ops.dtmega.recomputed_attention_backward.default}

    def __init__(self):
        super().__init__()
        self.forwards = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.forwards += func in self.FORWARDS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("every, recomputed", [(2, 2), (1, 4)])
def test_selective_recompute_runs_the_attention_again_in_backward(every, recomputed):
    """4 blocks: one attention forward each, plus one more in backward per recomputed core."""
    _, pm = parallel_llama([Recompute("selective", every=every)])
    with _CountAttention() as counter:
        pm.forward_backward(dtmega.synthetic_batch(2, 8, 256))
    assert counter.forwards == 4 + recomputed
    _, plain = parallel_llama([])
    with _CountAttention() as counter:
        plain.forward_backward(dtmega.synthetic_batch(2, 8, 256))
    assert counter.forwards == 4


def test_bad_batches_are_rejected():
    _, pm = parallel_llama([])
    tokens = torch.randint(0, 256, (2, 8))
    with pytest.raises(TypeError, match="must be a tensordict.TensorDict"):
        pm.forward_backward({"tokens": tokens, "labels": tokens})
    with pytest.raises(KeyError, match="missing \\['labels'\\]"):
        pm.forward_backward(TensorDict({"tokens": tokens}, batch_size=[2, 8]))
    with pytest.raises(ValueError, match=r"ids in \[\d+, 300\].*vocabulary is \[0, 256\)"):
        bad = tokens.clone()
        bad[0, 0] = 300
        pm.forward_backward(dtmega.make_batch(bad, tokens))
    with pytest.raises(TypeError, match="integer token ids"):
        pm.forward_backward(dtmega.make_batch(tokens.float(), tokens))
    with pytest.raises(dtmega.PlanError, match="cannot be split into 3 equal micro-batches"):
        pm.forward_backward(dtmega.make_batch(tokens, tokens), microbatches=3)
    with pytest.raises(ValueError, match="no token with loss_mask=1"):
        pm.forward_backward(dtmega.make_batch(tokens, tokens, torch.zeros(2, 8)))


def test_report_and_log_describe_the_plan():
    _, pm = parallel_llama([Recompute("full")])
    assert any("Recompute" in line for line in pm.log)
    table = pm.report()
    assert table.row_count > 5 and "parameters on rank 0" in table.caption
