"""`dtmega evaluate`: loss and perplexity of a checkpoint on a dataset, or an evaluation task.

    dtmega evaluate --load runs/demo/checkpoints --data-path data/heldout_text_document
    torchrun --nproc-per-node 4 -m dtmega evaluate --load ckpt --data-path d --tensor-model-parallel-size 2
    dtmega evaluate --load ckpt --task wikitext --valid-data wikitext-103/wiki.test.tokens --overlapping-eval 32
    dtmega evaluate --load ckpt --task lambada --valid-data lambada_test.jsonl --strict-lambada
    dtmega evaluate --load sft-ckpt --data-path data/chat [--sft]    # packed chat samples: the answers' loss
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import torch.distributed as dist

from dtmega.data.blend import DataConfig, build_datasets, parse_data_path
from dtmega.data.indexed import IndexedDataset
from dtmega.data.sft_dataset import SFTDataset, check_sft_file, is_sft_data, read_header, sft_datasets
from dtmega.data.vocab_check import check_data_ids
from dtmega.printing import console
from dtmega.progress import progress_bar
from dtmega.train.args import ArgumentError, TrainArgs
from dtmega.train.evaluate_loss import evaluate_loss
from dtmega.train.restore import add_model_source, restore_with_progress
from dtmega.train.setup import run_shape


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtmega evaluate", description="Validation loss and perplexity of a checkpoint.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_source(p)
    p.add_argument("--data-path", nargs="+", help="dataset prefix(es), optionally weighted (the split evaluation)")
    p.add_argument("--sft", action="store_true",
                   help="--data-path is packed chat samples (dtmega preprocess --chat, as dtmega train --sft reads): "
                        "the loss on the assistant's tokens only, attention within each conversation (default: on "
                        "when --data-path names only such a file)")
    p.add_argument("--task", choices=("wikitext", "lambada"),
                   help="an evaluation task on --valid-data instead of a dataset split (docs/evaluation.md)")
    p.add_argument("--valid-data", help="the task's file: WikiText text (wiki.test.tokens) or LAMBADA JSONL")
    p.add_argument("--overlapping-eval", type=int, default=32,
                   help="wikitext: tokens between window starts; each window scores only its last this many")
    p.add_argument("--strict-lambada", action="store_true",
                   help="lambada: every token of the whole last word must be predicted (default: the last token)")
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


def check_arguments(a: argparse.Namespace) -> None:
    """Which evaluation, and its settings, checked before the checkpoint is read."""
    if a.task is None:
        if not a.data_path:
            raise ArgumentError("give --data-path (the loss on a dataset's validation split) or --task wikitext|lambada "
                                "with --valid-data FILE")
        if a.valid_data or a.strict_lambada:
            raise ArgumentError("--valid-data and --strict-lambada belong to --task. Fix: add --task wikitext|lambada")
        if a.sft and len(a.data_path) != 1:
            raise ArgumentError("--sft reads one packed chat file: --data-path PREFIX (as `dtmega preprocess --chat "
                                "--output-prefix PREFIX` wrote it). Fix: one prefix, without a weight")
        return
    if a.sft:
        raise ArgumentError(f"--sft evaluates packed chat samples of --data-path; --task {a.task} reads --valid-data. "
                            "Fix: drop one of them")
    if a.data_path:
        raise ArgumentError(f"--task {a.task} evaluates --valid-data, not --data-path. Fix: drop one of them")
    split_only = [flag for flag, value in (("--split", a.split), ("--global-batch-size", a.global_batch_size),
                                           ("--seed", a.seed), ("--eval-iters", a.eval_iters)) if value is not None]
    if split_only:
        raise ArgumentError(f"{', '.join(split_only)} belong(s) to the split evaluation (--data-path); --task "
                            f"{a.task} reads all of --valid-data. Fix: drop {', '.join(split_only)}")
    if not a.valid_data:
        raise ArgumentError(f"--task {a.task} needs --valid-data FILE (WikiText text, or LAMBADA JSONL)")
    if not Path(a.valid_data).is_file():
        raise ArgumentError(f"--valid-data {a.valid_data} is not a file. Fix: the path of a "
                            + ("WikiText file, e.g. wikitext-103/wiki.test.tokens" if a.task == "wikitext" else
                               "LAMBADA JSONL file (one {\"text\": ...} per line)"))
    if a.strict_lambada and a.task != "lambada":
        raise ArgumentError("--strict-lambada applies to --task lambada")
    if a.overlapping_eval < 1:
        raise ArgumentError(f"--overlapping-eval {a.overlapping_eval} must be at least 1")
    if a.micro_batch_size < 1:
        raise ArgumentError(f"--micro-batch-size {a.micro_batch_size} must be at least 1")


def run_task(a: argparse.Namespace, pm, tokenizer, state: dict):
    """`--task wikitext` or `--task lambada`: prints and returns the task's result."""
    from dtmega.tasks.run import evaluate_lambada, evaluate_wikitext

    context = int(state.get("model_config", {}).get("max_seq_len") or state["args"]["seq_length"])
    if a.task == "wikitext":
        seq_length, why = default_seq_length(a, state)
        console().print(f"[dim]note: windows of {seq_length} tokens ({why})[/dim]", highlight=False)
        if seq_length > context:
            raise ArgumentError(f"--seq-length {seq_length} exceeds the model's context of {context} tokens")
        if a.overlapping_eval > seq_length:
            raise ArgumentError(f"--overlapping-eval {a.overlapping_eval} exceeds --seq-length {seq_length}. "
                                f"Fix: --overlapping-eval {seq_length} or less")
        result = evaluate_wikitext(pm, tokenizer, a.valid_data, seq_length=seq_length,
                                   overlapping_eval=a.overlapping_eval, micro_batch=a.micro_batch_size)
        console().print(f"wikitext {a.valid_data}: {result.tokens} tokens, {result.words} words, {result.windows} "
                        f"windows of {seq_length} (overlapping eval {a.overlapping_eval}): loss {result.loss:.4f}, "
                        f"perplexity {result.perplexity:.3f}, adjusted perplexity {result.adjusted_perplexity:.3f}",
                        highlight=False)
        return result
    result = evaluate_lambada(pm, tokenizer, a.valid_data, strict=a.strict_lambada, context=context,
                              micro_batch=a.micro_batch_size)
    console().print(f"lambada {a.valid_data}{' (strict)' if result.strict else ''}: {result.correct}/{result.total} "
                    f"correct, accuracy {result.accuracy:.4f}", highlight=False)
    return result


def default_seq_length(a: argparse.Namespace, state: dict) -> tuple[int, str]:
    """The sample length and where it comes from; one rule for --load and --load-hf: the length
    the model was trained at. A dtmega run records it (its --seq-length); a Hugging Face model
    (read with --load-hf or converted by `dtmega convert hf-to-dtmega`) records only its context,
    max_position_embeddings, which is then the length. --seq-length overrides both."""
    if a.seq_length is not None:
        return a.seq_length, "--seq-length"
    context = state.get("model_config", {}).get("max_seq_len")
    if "hf_dir" in state.get("source", {}) and context:
        return int(context), "the Hugging Face model's context, max_position_embeddings; --seq-length N for others"
    return int(state["args"]["seq_length"]), "the training run's --seq-length; --seq-length N for others"


def uses_sft_data(a: argparse.Namespace) -> bool:
    """Whether --data-path is packed chat samples: --sft, or one prefix that names only such a
    file (its header read now, before the checkpoint: a wrong --sft fails at once)."""
    if a.task is not None:
        return False
    sft = a.sft or (len(a.data_path) == 1 and is_sft_data(a.data_path[0]))
    if sft:
        read_header(a.data_path[0])
    return sft


def sft_validation(a: argparse.Namespace, args: TrainArgs, global_batch: int,
                   run_iters: int | None) -> tuple[SFTDataset, int, int]:
    """(dataset, batches, distinct samples) of the packed chat file's validation split, as
    `dtmega train --sft` builds it (sft_datasets: consecutive samples by the split's weights)."""
    split = sft_datasets(a.data_path[0], args.seq_length, list(args.split_weights), {"valid": 1})["valid"]
    if split is None:
        raise ArgumentError(f"--split {args.split} leaves no samples of {a.data_path[0]}_sft.bin to evaluate. Fix: a "
                            "split with a validation part, e.g. --split 0,1,0")
    iters = a.eval_iters or run_iters or max(1, split.count // global_batch)
    return dataclasses.replace(split, length=max(split.count, iters * global_batch)), iters, split.count


def main(argv: list[str]):
    """Prints and returns the loss (a task: its result). On packed chat samples (SFT) the loss is
    over the answers' tokens only and attention stays within each conversation: the numbers the
    training run's validation reports on them."""
    a = build_parser().parse_args(argv)
    check_arguments(a)
    sft = uses_sft_data(a)
    pm, tokenizer, state = restore_with_progress(a.load, tp=a.tensor_model_parallel_size, data_parallel="ddp",
                                                 custom_import=a.custom_import, load_hf=a.load_hf,
                                                 document_masking=sft, tokenizer_model=a.tokenizer_model)
    if a.task is not None:
        return run_task(a, pm, tokenizer, state)
    if sft:
        seq_length = a.seq_length or read_header(a.data_path[0])["seq_length"]
        why = "--seq-length" if a.seq_length else "the packed chat file's --seq-length"
        console().print(f"[dim]note: {a.data_path[0]} holds packed chat samples (dtmega preprocess --chat): the loss "
                        "on the assistant's tokens only, as dtmega train --sft validates[/dim]", highlight=False)
    else:
        seq_length, why = default_seq_length(a, state)
    console().print(f"[dim]note: samples of {seq_length} tokens ({why})[/dim]", highlight=False)
    context = state.get("model_config", {}).get("max_seq_len")
    if context is not None and seq_length > context:  # before: an IndexError in the RoPE table
        raise ArgumentError(f"--seq-length {seq_length} is longer than the model's context of {context} tokens (its "
                            f"max position embeddings). Fix: --seq-length {context} or less")
    if sft:
        check_sft_file(a.data_path[0], seq_length, tokenizer.vocab_size)
    for _, prefix in ([] if sft else parse_data_path(a.data_path)):
        check_data_ids(prefix, tokenizer.vocab_size, "the checkpoint")  # the tokenizer's ids, not the padded table
    run = state["args"]
    seed = a.seed if a.seed is not None else run.get("seed", 1234)
    split, global_batch, micro, run_iters = settings(a, run, dist.get_world_size())
    args = TrainArgs(data_path=a.data_path, split=split, seq_length=seq_length, micro_batch_size=micro,
                     global_batch_size=global_batch, tensor_model_parallel_size=a.tensor_model_parallel_size,
                     data_parallel="ddp", seed=seed)
    shape = run_shape(args, dist.get_world_size())
    if sft:
        dataset, iters, distinct = sft_validation(a, args, shape.global_batch, run_iters)
    else:
        tokens = sum(IndexedDataset(p).num_tokens for _, p in parse_data_path(a.data_path))
        iters = a.eval_iters or run_iters or max(1, (tokens - 1) // seq_length // shape.global_batch)
        dataset = build_datasets(DataConfig(tuple(a.data_path), args.split_weights, seq_length, seed),
                                 {"valid": iters * shape.global_batch})["valid"]
        if dataset is None:
            raise ArgumentError(f"--split {a.split} leaves no documents to evaluate")
        distinct = getattr(dataset, "samples_per_epoch", None)
    args = dataclasses.replace(args, eval_iters=iters)
    if distinct is not None and iters * shape.global_batch > distinct:
        once = max(1, distinct // shape.global_batch)
        console().print(f"[yellow]note:[/yellow] the held-out data holds {distinct} samples of {seq_length} tokens; "
                        f"{iters} batches of {shape.global_batch} read some of them more than once. --eval-iters "
                        f"{once} reads each at most once", highlight=False)
    with progress_bar("evaluate", total=iters, unit="batches") as bar:
        loss = evaluate_loss(pm, dataset, args, shape, tokenizer.eod, on_batch=bar.advance)
    console().print(f"{iters * shape.global_batch} samples x {seq_length} tokens: loss {loss:.4f}, "
                    f"perplexity {math.exp(min(loss, 50.0)):.3f}" + (" (the answers' tokens)" if sft else ""))
    return loss
