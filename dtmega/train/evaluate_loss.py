"""The validation loss: the token-weighted mean over a dataset's first --eval-iters global
batches, as the trainer's validation and `dtmega evaluate` compute it."""

from __future__ import annotations

from typing import Callable

import dtmega
from dtmega.data.loader import BatchLoader
from dtmega.stop_signals import raise_if_stopped
from dtmega.train.args import TrainArgs


def evaluate_loss(pm: dtmega.ParallelModel, dataset, args: TrainArgs, shape, eod: int,
                  on_batch: Callable[[], None] | None = None) -> float:
    """Token-weighted mean loss over the first `eval_iters` global batches of `dataset`;
    `on_batch()` after each (a progress bar's `advance`)."""
    loader = BatchLoader(dataset, shape.global_batch, pm.dp_rank, shape.dp, eod=eod,
                         eod_mask_loss=args.eod_mask_loss, reset_position_ids=args.reset_position_ids,
                         reset_attention_mask=args.reset_attention_mask)
    total, tokens = 0.0, 0.0
    pm.eval()
    for _, batch in zip(range(args.eval_iters), loader):
        raise_if_stopped()
        loss_sum, count = pm.loss_sum(batch.to(pm.mesh.device_type))
        total, tokens = total + float(loss_sum), tokens + float(count)
        if on_batch is not None:
            on_batch()
    pm.train()
    return total / max(tokens, 1.0)

