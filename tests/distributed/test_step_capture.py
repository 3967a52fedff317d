"""Whole-step capture (issue 36): `dtmega.capture_step` compiles forward, backward, the
optimizer step and the after-step hooks as one program (aot_eager on this CPU: the graphs
inductor would get, run without code generation). Under TP2+SP, FSDP2, PP2 and CP2, and with
FP8 delayed scaling (whose scale update is an after-step hook), training with it equals the
unsharded model over 5 AdamW steps (loss, every gradient, every parameter) at the suite's
1e-5, and the capture says what it compiled and why anything runs outside it."""

from __future__ import annotations

import pytest
import torch

import dtmega
from dtmega.passes import ContextParallel, DataParallel, Float8, PipelineSplit, SequenceParallel, TensorParallel
from tests.helpers import assert_close_to_reference, build_dtmega_llama, compare_training, debug_llama, first_copy_mesh

PLANS = {
    "tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel()]),
    "fsdp2": (dict(dp_shard=2), [DataParallel("fsdp")]),
    "pp2": (dict(pp=2), [PipelineSplit(microbatches=2), DataParallel("ddp")]),
    "cp2": (dict(cp=2), [ContextParallel(method="all_gather"), DataParallel("fsdp")]),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_a_captured_step_trains_as_the_unsharded_model(name):
    sizes, passes = PLANS[name]
    # two blocks (PP2: one per stage): what the capture meets is the same per block, and tracing is slow
    config = debug_llama(tie_embeddings=False, n_layers=2) if "pp" in sizes else debug_llama(n_layers=2)
    reference, meta_copy = build_dtmega_llama(config, seed=71)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(**sizes), dtmega.Plan(passes))
    pm.init_weights(seed=71)
    assert_close_to_reference(compare_training(reference, pm, steps=5, seq_len=16,
                                               batch_size=8 if "pp" in sizes else 4, capture="aot_eager"))


def test_a_captured_fp8_step_equals_the_eager_step():
    """FP8 delayed scaling under TP2+SP, in float64 (the same FP8 values on both sides, as
    tests/distributed/test_float8.py argues): its amax reduction and scale update run as the
    captured program's after-step hook and give the eager run's losses and weights (1e-5)."""
    _, meta_copy = build_dtmega_llama(debug_llama(tie_embeddings=False, n_layers=1), seed=73)  # tracing FP8 is slow
    models = []
    for _ in range(2):
        plan = dtmega.Plan([TensorParallel(), SequenceParallel(),
                            Float8(recipe="delayed", amax_history_len=4, min_features=16)])
        pm = dtmega.parallelize(meta_copy().to(torch.float64), first_copy_mesh(tp=2), plan)
        pm.init_weights(seed=73)
        models.append(pm)
    eager, captured = models
    # float64 all the way: a compiled AdamW computes its bias corrections from its `step` tensors
    # (the default dtype) where the eager one takes Python floats; in fp32 that alone moves the
    # weights by ~1e-6, enough to round some FP8 values the other way
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        worst = _train_both(eager, captured)
    finally:
        torch.set_default_dtype(default)
    assert worst <= 1e-5, worst


def _train_both(eager, captured) -> float:
    """The worst relative error of the captured run against the eager one over 5 AdamW steps:
    losses, weights, FP8 histories and scales."""
    from tests.helpers import full, relative_error

    lr = torch.tensor(1e-3)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=lr.clone(), eps=1e-5)
    step = dtmega.capture_step(captured, torch.optim.AdamW(captured.parameters(), lr=lr.clone(), eps=1e-5),
                               backend="aot_eager", verbose=False)
    worst = 0.0
    for index in range(5):
        batch = eager.shard_batch(dtmega.synthetic_batch(4, 16, 256, seed=200 + index))
        eager_opt.zero_grad()
        loss = eager.forward_backward(batch)
        eager_opt.step()
        eager.after_optimizer_step()
        worst = max(worst, relative_error(step(batch), loss))
        for (_, a), (_, b) in zip(captured.named_parameters(), eager.named_parameters()):
            worst = max(worst, relative_error(full(a.detach()), full(b.detach())))
    scales = [captured.runtime_state_dict(), eager.runtime_state_dict()]
    assert scales[0].keys() == scales[1].keys() and scales[0]
    return max([worst] + [relative_error(scales[0][key], scales[1][key]) for key in scales[0]])
