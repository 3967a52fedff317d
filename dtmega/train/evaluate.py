"""`dtmega evaluate`: loss and perplexity of a checkpoint on a dataset.

    dtmega evaluate --load runs/demo/checkpoints --data-path data/heldout_text_document
    torchrun --nproc-per-node 4 -m dtmega evaluate --load ckpt --data-path d --tensor-model-parallel-size 2
"""

from __future__ import annotations

import argparse
import math

import torch.distributed as dist
from dtmega.printing import console

from dtmega.data.blend import DataConfig, build_datasets, parse_data_path
from dtmega.data.indexed import IndexedDataset, read_stats
from dtmega.train.args import ArgumentError, TrainArgs
from dtmega.train.restore import restore
from dtmega.train.setup import run_shape
from dtmega.train.trainer import evaluate_loss


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtmega evaluate", description="Validation loss and perplexity of a checkpoint.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint (a --save directory or an iter_* directory)")
    p.add_argument("--data-path", nargs="+", required=True, help="dataset prefix(es), optionally weighted")
    p.add_argument("--split", help="which documents: the validation part of this split (default: the training run's "
                                   "split on the run's own data, so its validation loss is reproduced; all of any "
                                   "other data)")
    p.add_argument("--seq-length", type=int, help="tokens per sample (default: the training run's)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per rank per forward")
    p.add_argument("--global-batch-size", type=int, help="sequences per batch (default: the run's on its own data, "
                                                         "else micro batch x data-parallel size)")
    p.add_argument("--seed", type=int, help="sample order (default: the training run's, so its validation set is reproduced)")
    p.add_argument("--eval-iters", type=int, help="global batches to evaluate (default: the run's --eval-iters on its "
                                                  "own data, else the whole split once)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size (launch that many ranks)")
    p.add_argument("--custom-import", nargs="+", default=[], help="modules that register the checkpoint's model")
    return p


def settings(a: argparse.Namespace, run: dict, world: int) -> tuple[str, int | None, int, int | None]:
    """(split, global batch, micro batch, batches) to evaluate. On the run's own data with nothing
    else given they are the run's validation settings (same documents, same samples, same count),
    so the printed loss is the run's last validation loss; on other data, all of it, once."""
    own = (list(a.data_path) == list(run.get("data_path", [])) and a.seq_length in (None, run["seq_length"])
           and a.split is None and a.global_batch_size is None)
    split = a.split or (run.get("split", "969,30,1") if own else "0,1,0")
    global_batch = a.global_batch_size or (run.get("global_batch_size") if own else None)
    micro, dp = a.micro_batch_size, max(1, world // a.tensor_model_parallel_size)
    if global_batch is not None and global_batch % (micro * dp):
        if global_batch % dp:
            raise ArgumentError(f"the global batch of {global_batch} sequences does not split over {dp} data-parallel "
                                "ranks. Fix: pass --global-batch-size with a multiple of them")
        micro = global_batch // dp  # the run's batch on this launch's ranks: one micro-batch each
    return split, global_batch, micro, (run.get("eval_iters") if own else None)


def main(argv: list[str]) -> float:
    """Prints and returns the loss."""
    a = build_parser().parse_args(argv)
    pm, tokenizer, state = restore(a.load, tp=a.tensor_model_parallel_size, data_parallel="ddp",
                                   custom_import=a.custom_import)
    seq_length = a.seq_length or state["args"]["seq_length"]
    for _, prefix in parse_data_path(a.data_path):
        stats = read_stats(prefix)
        if stats and stats["max_token_id"] >= pm.program.facts.vocab_size:
            raise ArgumentError(f"{prefix} holds token id {stats['max_token_id']}, beyond the model's vocabulary")
    run = state["args"]
    seed = a.seed if a.seed is not None else run.get("seed", 1234)
    split, global_batch, micro, run_iters = settings(a, run, dist.get_world_size())
    args = TrainArgs(data_path=a.data_path, split=split, seq_length=seq_length, micro_batch_size=micro,
                     global_batch_size=global_batch, tensor_model_parallel_size=a.tensor_model_parallel_size,
                     data_parallel="ddp", seed=seed)
    shape = run_shape(args, dist.get_world_size())
    tokens = sum(IndexedDataset(p).num_tokens for _, p in parse_data_path(a.data_path))
    iters = a.eval_iters or run_iters or max(1, (tokens - 1) // seq_length // shape.global_batch)
    args.eval_iters = iters
    dataset = build_datasets(DataConfig(tuple(a.data_path), args.split_weights, seq_length, seed),
                             {"valid": iters * shape.global_batch})["valid"]
    if dataset is None:
        raise ArgumentError(f"--split {a.split} leaves no documents to evaluate")
    loss = evaluate_loss(pm, dataset, args, shape, tokenizer.eod)
    console().print(f"{iters * shape.global_batch} samples x {seq_length} tokens: loss {loss:.4f}, "
                    f"perplexity {math.exp(min(loss, 50.0)):.3f}")
    return loss
