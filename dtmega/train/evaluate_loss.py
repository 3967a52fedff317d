"""The validation loss: the token-weighted mean over --eval-iters global batches of a dataset,
from a position on (the trainer's validations read on where the last one stopped, as Megatron's
validation iterator does; `dtmega evaluate` reads from the start)."""

from __future__ import annotations

from typing import Callable

import dtmega
from dtmega.data.loader import BatchLoader
from dtmega.stop_signals import raise_if_stopped
from dtmega.train.args import TrainArgs
from dtmega.train.eval_batch import eval_batch


def evaluate_loss(pm: dtmega.ParallelModel, dataset, args: TrainArgs, shape, eod: int,
                  on_batch: Callable[[], None] | None = None, start: int = 0) -> float:
    """Token-weighted mean loss over `eval_iters` global batches of `dataset` from position
    `start`; `on_batch()` after each (a progress bar's `advance`). The batches are
    --eval-global-batch-size sequences in micro-batches of --eval-micro-batch-size (each the
    training's when not given)."""
    size = eval_batch(args, shape)
    loader = BatchLoader(dataset, size.global_batch, pm.dp_rank, shape.dp, eod=eod,
                         eod_mask_loss=args.eod_mask_loss, reset_position_ids=args.reset_position_ids,
                         reset_attention_mask=args.reset_attention_mask, consumed_samples=start,
                         micro_batch=size.micro_batch)
    total, tokens = 0.0, 0.0
    pm.eval()
    for _, batch in zip(range(args.eval_iters), loader):
        raise_if_stopped()
        loss_sum, count = pm.loss_sum(batch.to(pm.mesh.device_type), microbatches=size.microbatches)
        total, tokens = total + float(loss_sum), tokens + float(count)
        if on_batch is not None:
            on_batch()
    pm.train()
    return total / max(tokens, 1.0)

