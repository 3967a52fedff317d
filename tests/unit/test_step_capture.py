"""Whole-step capture on one rank (issue 36; the plans against the unsharded model:
tests/distributed/test_step_capture.py): the compiled step equals the eager step (which equals
the unsharded model: tests/unit/test_single_rank.py) over 5 AdamW steps, it is
really compiled (graphs counted, the backward traced into them), FP8 delayed scaling (its
backward's amax record and the after-step scale update inside the program) equals the eager
run, and it says why anything stays outside: a Python-float learning rate, CUDA graphs'
conditions, bad arguments."""

from __future__ import annotations

import pytest
import torch

import dtmega
from dtmega.models import LlamaConfig
from dtmega.passes import Float8, Plan, PlanError
from dtmega.step_capture import CapturedStep
from tests.helpers import (
    build_dtmega_llama,
    debug_llama,
    full,
    relative_error,
)


def _one_rank(config=None, seed=5):
    # two blocks: what the capture meets is the same in every block, and tracing is slow
    reference, meta_copy = build_dtmega_llama(config or debug_llama(n_layers=2), seed=seed)
    pm = dtmega.parallelize(meta_copy(), dtmega.make_mesh(device_type="cpu"), Plan([]))
    pm.init_weights(seed=seed)
    return reference, pm


def test_the_captured_step_equals_the_eager_step():
    _, eager = _one_rank(seed=6)
    _, captured = _one_rank(seed=6)
    worst, step = _train_both(eager, captured, seed=100, masked_fraction=0.25, weight_decay=0.1)
    assert worst <= 1e-5, worst
    report = step.report
    # one program for forward and backward, one for the optimizer step (torch's optimizer breaks
    # the graph around its step by design): the backward is traced, not a break
    assert report.scope == "step" and 2 <= report.graphs <= 3, report.describe()
    assert not any("backward" in reason for reason in report.breaks), report.describe()
    assert step.reasons == []  # the learning rate is a tensor; no GPU, so no CUDA graphs to explain



def test_a_captured_fp8_step_equals_the_eager_step():
    """FP8 delayed scaling, in float64 (both runs then hold the same FP8 values, as
    tests/distributed/test_float8.py argues): the backward's amax record runs inside the traced
    program, the scale update as its after-step hook, and the step recompiles when the history
    starts (step 2 scales from it, step 1 from the tensors). Losses, weights, amax histories and
    scales equal the eager run's (1e-5; in fp32 optimizer arithmetic they drift 0.04 apart by
    step 2, see below)."""
    _, meta_copy = build_dtmega_llama(debug_llama(tie_embeddings=False, n_layers=1), seed=73)  # tracing FP8 is slow
    models = []
    for _ in range(2):
        plan = Plan([Float8(recipe="delayed", amax_history_len=4, min_features=16)])
        pm = dtmega.parallelize(meta_copy().to(torch.float64), dtmega.make_mesh(device_type="cpu"), plan)
        pm.init_weights(seed=73)
        models.append(pm)
    # float64 all the way: a compiled AdamW computes its bias corrections from its `step` tensors
    # (the default dtype) where the eager one takes Python floats; in fp32 that alone moves the
    # weights by ~1e-6, enough to round some FP8 values the other way
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        worst, _ = _train_both(*models, seed=200)
    finally:
        torch.set_default_dtype(default)
    assert models[0].runtime_state_dict(), "no FP8 state was compared"
    assert worst <= 1e-5, worst


def _train_both(eager, captured, *, seed: int, masked_fraction: float = 0.0, weight_decay: float = 0.01):
    """(worst relative error of the captured run against the eager one over 5 AdamW steps:
    losses, weights and the hooks' state such as FP8 histories and scales; the captured step)."""
    def adamw(pm):
        return torch.optim.AdamW(pm.parameters(), lr=torch.tensor(1e-3), eps=1e-5, weight_decay=weight_decay)

    eager_opt = adamw(eager)
    step = dtmega.capture_step(captured, adamw(captured), backend="aot_eager", verbose=False)
    worst = 0.0
    for index in range(5):
        batch = dtmega.synthetic_batch(4, 16, 256, seed=seed + index, masked_fraction=masked_fraction)
        eager_opt.zero_grad()
        loss = eager.forward_backward(batch)
        eager_opt.step()
        eager.after_optimizer_step()
        worst = max(worst, relative_error(step(batch), loss))
        for (_, a), (_, b) in zip(captured.named_parameters(), eager.named_parameters()):
            worst = max(worst, relative_error(full(a.detach()), full(b.detach())))
    states = [captured.runtime_state_dict(), eager.runtime_state_dict()]
    assert states[0].keys() == states[1].keys()
    return max([worst] + [relative_error(states[0][key], states[1][key]) for key in states[0]]), step


def test_the_capture_says_why_it_falls_back():
    _, pm = _one_rank()
    step = CapturedStep(pm, torch.optim.AdamW(pm.parameters(), lr=1e-3), backend="aot_eager", verbose=False)
    assert any("Python float" in reason for reason in step.reasons)
    assert CapturedStep._cuda_graph_blockers(pm, "inductor", "cuda") == []
    assert "inductor" in CapturedStep._cuda_graph_blockers(pm, "aot_eager", "cuda")[0]
    assert CapturedStep._cuda_graph_blockers(pm, "inductor", "cpu") == ["CUDA graphs need a GPU"]
    _, moe = _one_rank(LlamaConfig.from_name("debug-moe"), seed=7)
    assert any("mixture of experts" in reason for reason in CapturedStep._cuda_graph_blockers(moe, "inductor", "cuda"))


@pytest.mark.parametrize("kwargs, message", [(dict(backend="tvm"), "unknown"),
                                             (dict(cuda_graphs=True), "CUDA graphs need a GPU")])
def test_bad_capture_arguments_are_refused(kwargs, message):
    _, pm = _one_rank()
    with pytest.raises(PlanError, match=message):
        dtmega.capture_step(pm, torch.optim.AdamW(pm.parameters(), lr=torch.tensor(1e-3)), **kwargs)


def test_the_benchmark_runs_and_the_captured_losses_are_the_eager_ones(tmp_path):
    from benchmarks.step_capture import main

    result = main(["--seq", "32", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "capture.json")])
    eager, captured = result["rows"]
    assert captured["loss_vs_eager"] <= 1e-5 and "compiled graph" in captured["capture"]
    assert (tmp_path / "capture.json").exists()
