"""Passes of one's own beside the standard ones, built for real (issue 47): FSDP units on the later
blocks only (DataParallel keeps the units another pass chose), and the trainer running a plan
file's tensor parallelism under the flags' sequence parallelism and FSDP."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule

import dtmega
from dtmega.passes import DataParallel, Plan
from dtmega.train.args import parse_train_args
from dtmega.train.trainer import Trainer
from tests.helpers import (
    LOSS_RTOL,
    assert_close_to_reference,
    build_dtmega_llama,
    compare_training,
    debug_llama,
    first_copy_mesh,
    mesh,
    relative_error,
)
from tests.train_helpers import tiny_args
from tests.user_passes import LaterBlocksAsUnits

PLAN = Path(__file__).resolve().parents[2] / "examples" / "mlp_tp_plan.toml"


def test_fsdp_on_the_later_blocks_only_builds_those_units_and_matches_unsharded():
    reference, meta_copy = build_dtmega_llama(debug_llama(), seed=21)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(dp_shard=2), Plan([LaterBlocksAsUnits(first=2),
                                                                            DataParallel("fsdp")]))
    pm.init_weights(seed=21)
    units = [fqn for fqn, module in pm.module.named_modules() if isinstance(module, FSDPModule)]
    assert units == ["", "layers.2", "layers.3"]  # before: every block was a unit
    assert_close_to_reference(compare_training(reference, pm, steps=3))


def _train(argv: list[str]) -> Trainer:
    trainer = Trainer(*parse_train_args(argv), mesh=mesh(tp=2, dp_shard=2))
    trainer.result = trainer.run()
    return trainer


def test_the_trainer_runs_a_plan_file_under_the_flags_sequence_parallelism_and_fsdp(corpus):
    """MLP-only tensor parallelism (examples/custom_pass.py) from a plan file, with the flags'
    SequenceParallel and FSDP: the layout says so, and the run's losses are those of the flags'
    own tensor parallelism (the same model; sums in other orders)."""
    flags = dict(tensor_model_parallel_size=2, sequence_parallel=True, use_distributed_optimizer=True, train_iters=6,
                 eval_iters=0)
    custom = _train(tiny_args(corpus, plan=str(PLAN), **flags))
    layout = custom.pm.layout
    assert [p.name for p in custom.plan] == ["MLPTensorParallel", "SequenceParallel", "FuseKernels", "DataParallel"]
    assert layout["layers.0.feed_forward.w1"].params["weight"].placements == {"tp": "S(0)", "dp_shard": "S(0)"}
    assert layout["layers.0.attention.wq"].params["weight"].placements == {"dp_shard": "S(0)"}
    standard = _train(tiny_args(corpus, **flags))
    assert len(custom.result.losses) == 6
    assert relative_error(torch.tensor(custom.result.losses), torch.tensor(standard.result.losses)) < LOSS_RTOL
