"""The validation batch: --eval-global-batch-size and --eval-micro-batch-size (Megatron's; each
defaults to its training counterpart), checked at start-up as Megatron's arguments.py checks them,
and under pipeline parallelism against the schedule the validation's micro-batch count needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtmega.train.arg_fields import ArgumentError


@dataclass(frozen=True)
class EvalBatch:
    """Sequences per validation batch over all data-parallel ranks, per micro-batch, and the
    micro-batches each rank splits its share into (None: the training's own split)."""

    global_batch: int
    micro_batch: int
    microbatches: int | None


def eval_batch(args: Any, shape: Any, plan: Any = None) -> EvalBatch:
    """The run's validation batch; ArgumentError when the sizes do not split over the
    data-parallel ranks, or (given the `plan`) when a pipeline schedule cannot run that many
    micro-batches."""
    if args.eval_global_batch_size is None and args.eval_micro_batch_size is None:
        return EvalBatch(shape.global_batch, shape.micro_batch, None)
    global_batch = args.eval_global_batch_size or shape.global_batch
    micro = args.eval_micro_batch_size or shape.micro_batch
    if global_batch % (micro * shape.dp):
        raise ArgumentError(
            f"--eval-global-batch-size {global_batch} is not divisible by --eval-micro-batch-size {micro} x "
            f"data-parallel size {shape.dp} (= {micro * shape.dp}), as Megatron requires. Fix: a multiple of "
            f"{micro * shape.dp}, e.g. {max(1, global_batch // (micro * shape.dp)) * micro * shape.dp}"
        )
    microbatches = global_batch // (micro * shape.dp)
    if plan is not None and shape.pp > 1:
        from dtmega.passes import PipelineSplit, PlanError
        from dtmega.passes.pipeline_runtime import check_microbatches

        split = next(item for item in plan.passes if isinstance(item, PipelineSplit))
        try:
            check_microbatches(split.schedule, split.virtual_stages, microbatches, shape.pp)
        except PlanError as error:
            raise ArgumentError(
                f"--eval-global-batch-size {global_batch} / (--eval-micro-batch-size {micro} x data-parallel size "
                f"{shape.dp}) = {microbatches} validation micro-batches per rank: {error}. Fix: a larger "
                "--eval-global-batch-size or a smaller --eval-micro-batch-size"
            ) from None
    return EvalBatch(global_batch, micro, microbatches)
