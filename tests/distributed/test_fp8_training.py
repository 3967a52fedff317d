"""`dtmega train` with Megatron's FP8 flags on 4 ranks (TP2 + SP x FSDP2): an exact resume that
needs the checkpointed amax histories, and checkpoints moving between FP8 and non-FP8 runs."""

from __future__ import annotations

import math

import pytest

from tests.train_helpers import tiny_args
from tests.train_helpers import train_reusing_meshes as train

PLAN = {"tensor_model_parallel_size": 2, "sequence_parallel": True, "use_distributed_optimizer": True}
# Delayed scaling with a history: the scales at step 5 come from steps 1-4, so a resume that
# did not restore the histories would quantize step 5 differently.
FP8 = {"fp8_hybrid": True, "fp8_recipe": "delayed", "fp8_amax_history_len": 4, "fp8_amax_compute_algo": "max",
       "fp8_min_features": 16}


@pytest.fixture(scope="module")
def fp8_eight_steps(corpus, shared_dir):
    save = shared_dir / "fp8"
    return train(tiny_args(corpus, train_iters=8, save=save, save_interval=4, **PLAN, **FP8)), save


def test_fp8_resume_reproduces_the_uninterrupted_losses(corpus, fp8_eight_steps):
    full, save = fp8_eight_steps
    resumed = train(tiny_args(corpus, train_iters=8, load=save / "iter_0000004", **PLAN, **FP8))
    # Exact: same plan, same ranks, same kernels, and the histories and scales restored (checked
    # by mutation: with the runtime state not loaded, step 5's loss differs).
    assert len(full.losses) == 8 and resumed.losses == full.losses[4:]
    # The linears did run in FP8: the same run without it has other losses, within FP8's noise.
    plain = train(tiny_args(corpus, train_iters=8, **PLAN))
    assert plain.losses != full.losses
    assert all(abs(a / b - 1) < 5e-2 for a, b in zip(full.losses, plain.losses))


def test_checkpoints_move_between_fp8_and_non_fp8_runs(corpus, fp8_eight_steps, shared_dir):
    _, save = fp8_eight_steps
    without = train(tiny_args(corpus, train_iters=6, load=save / "iter_0000004", **PLAN))
    assert len(without.losses) == 2 and all(math.isfinite(x) for x in without.losses)
    plain_save = shared_dir / "no_fp8"
    train(tiny_args(corpus, train_iters=4, save=plain_save, save_interval=4, **PLAN))
    into_fp8 = train(tiny_args(corpus, train_iters=6, load=plain_save / "iter_0000004", **PLAN, **FP8))
    assert len(into_fp8.losses) == 2 and all(math.isfinite(x) for x in into_fp8.losses)


def test_fp8_param_gather_trains_and_resumes_like_the_fp32_gather(corpus, fp8_eight_steps, shared_dir):
    """--fp8-param-gather: FSDP2 gathers each weight as FP8 bytes cast with the whole weight's
    scale, the same FP8 values the linear would cast from a gathered fp32 weight, so the losses
    equal the run without it (1e-6: the same arithmetic in the same order; measured equal), and
    its checkpoints resume exactly (the sharded weights are saved as plain tensors)."""
    full, _ = fp8_eight_steps
    save = shared_dir / "fp8_gather"
    gathered = train(tiny_args(corpus, train_iters=8, save=save, save_interval=4, fp8_param_gather=True, **PLAN, **FP8))
    assert len(gathered.losses) == 8
    assert all(abs(a / b - 1) <= 1e-6 for a, b in zip(gathered.losses, full.losses)), (gathered.losses, full.losses)
    resumed = train(tiny_args(corpus, train_iters=8, load=save / "iter_0000004", fp8_param_gather=True, **PLAN, **FP8))
    assert resumed.losses == gathered.losses[4:]
