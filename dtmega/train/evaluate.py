"""`dtmega evaluate`: loss and perplexity of a checkpoint on a dataset.

    dtmega evaluate --load runs/demo/checkpoints --data-path data/heldout_text_document
    torchrun --nproc-per-node 4 -m dtmega evaluate --load ckpt --data-path d --tensor-model-parallel-size 2
"""

from __future__ import annotations

import argparse
import math

import torch.distributed as dist
from rich.console import Console

from dtmega.data.blend import DataConfig, build_datasets, parse_data_path
from dtmega.data.indexed import IndexedDataset, read_stats
from dtmega.train.args import ArgumentError, TrainArgs
from dtmega.train.restore import restore
from dtmega.train.setup import run_shape
from dtmega.train.trainer import evaluate_loss


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtmega evaluate", description="Validation loss and perplexity of a checkpoint.")
    p.add_argument("--load", required=True, help="checkpoint (a --save directory or an iter_* directory)")
    p.add_argument("--data-path", nargs="+", required=True, help="dataset prefix(es), optionally weighted")
    p.add_argument("--split", default="0,1,0", help="which documents: the validation part of this split (default: all; pass the training run's --split to evaluate its validation documents)")
    p.add_argument("--seq-length", type=int, help="tokens per sample (default: the training run's)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, help="sequences per batch (default: micro batch x data-parallel size)")
    p.add_argument("--seed", type=int, help="sample order (default: the training run's, so its validation set is reproduced)")
    p.add_argument("--eval-iters", type=int, help="global batches to evaluate (default: the whole split once)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    return p


def main(argv: list[str]) -> float:
    """Prints and returns the loss."""
    a = build_parser().parse_args(argv)
    pm, tokenizer, state = restore(a.load, tp=a.tensor_model_parallel_size, data_parallel="ddp")
    seq_length = a.seq_length or state["args"]["seq_length"]
    for _, prefix in parse_data_path(a.data_path):
        stats = read_stats(prefix)
        if stats and stats["max_token_id"] >= pm.program.facts.vocab_size:
            raise ArgumentError(f"{prefix} holds token id {stats['max_token_id']}, beyond the model's vocabulary")
    seed = a.seed if a.seed is not None else state["args"].get("seed", 1234)
    args = TrainArgs(data_path=a.data_path, split=a.split, seq_length=seq_length, micro_batch_size=a.micro_batch_size,
                     global_batch_size=a.global_batch_size, tensor_model_parallel_size=a.tensor_model_parallel_size,
                     data_parallel="ddp", seed=seed)
    shape = run_shape(args, dist.get_world_size())
    tokens = sum(IndexedDataset(p).num_tokens for _, p in parse_data_path(a.data_path))
    iters = a.eval_iters or max(1, (tokens - 1) // seq_length // shape.global_batch)
    args.eval_iters = iters
    dataset = build_datasets(DataConfig(tuple(a.data_path), args.split_weights, seq_length, seed),
                             {"valid": iters * shape.global_batch})["valid"]
    if dataset is None:
        raise ArgumentError(f"--split {a.split} leaves no documents to evaluate")
    loss = evaluate_loss(pm, dataset, args, shape, tokenizer.eod)
    if dist.get_rank() == 0:
        Console().print(f"{iters * shape.global_batch} samples x {seq_length} tokens: loss {loss:.4f}, "
                        f"perplexity {math.exp(min(loss, 50.0)):.3f}")
    return loss
