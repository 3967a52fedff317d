"""What `dtmega train` decides before it touches a device: the run's shape, tokenizer, model
config and plan, from the arguments and the world size alone.

The trainer builds its run from `prepare_run`, and `dtmega train ... --dry-run [WORLD]` stops
right after it: the plan is annotated on a meta-device model for WORLD ranks (no process group,
no allocation), so a launch line for 64 GPUs is checked on a login node in seconds: flags,
config file, data and tokenizer files, divisibility of every parallel size, and the layout
with the bytes of parameters per rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dtmega.data.blend import parse_data_path
from dtmega.data.indexed import IndexedDataset, read_stats
from dtmega.data.tokenizers import Tokenizer, TokenizerSpec, build_tokenizer
from dtmega.models.llama_config import LlamaConfig
from dtmega.passes import Layout, Plan
from dtmega.train.args import ArgumentError, TrainArgs
from dtmega.train.checkpoint import read_state, resolve_checkpoint
from dtmega.train.setup import (
    RunShape, build_plan, model_config, reject_unsupported, run_shape, tokenizer_spec,
)


@dataclass
class RunPlan:
    """Everything about a run that is a pure function of its arguments and world size."""

    shape: RunShape
    tokenizer_spec: TokenizerSpec
    tokenizer: Tokenizer
    config: LlamaConfig
    plan: Plan
    unigram_entropy: float | None


def prepare_run(args: TrainArgs, world: int) -> RunPlan:
    """Checks the arguments and files and derives the run; ArgumentError (the same on every
    rank) for anything that cannot run."""
    reject_unsupported(args)
    missing = [flag for flag, value in (("--train-iters", args.train_iters), ("--lr", args.lr)) if value is None]
    if missing or not args.data_path:
        raise ArgumentError(f"dtmega train needs {', '.join(missing + (['--data-path'] if not args.data_path else []))}")
    shape = run_shape(args, world)
    spec = tokenizer_spec(args)
    tokenizer = build_tokenizer(spec)
    config = model_config(args, tokenizer.vocab_size)
    if args.load:
        config = vocab_from_checkpoint(args.load, config, tokenizer.vocab_size, shape.tp)
    for _, prefix in parse_data_path(list(args.data_path)):
        IndexedDataset(prefix)  # a missing or malformed .bin/.idx fails here, naming the file
    entropy = check_data_vocab(args, config.vocab_size)
    plan = build_plan(args, shape, config.n_layers)
    return RunPlan(shape, spec, tokenizer, config, plan, entropy)


def check_data_vocab(args: TrainArgs, vocab_size: int) -> float | None:
    """Fails if a dataset holds ids the model cannot embed; returns the (first) dataset's
    unigram entropy when preprocessing recorded it."""
    entropy = None
    for _, prefix in parse_data_path(list(args.data_path)):
        stats = read_stats(prefix)
        if stats is None:
            continue
        if stats["max_token_id"] >= vocab_size:
            raise ArgumentError(
                f"{prefix} holds token id {stats['max_token_id']}, but the model's vocabulary has {vocab_size} "
                "ids: the data was tokenized with a larger vocabulary than this run's tokenizer. Fix: pass the "
                "tokenizer the data was preprocessed with"
            )
        entropy = stats["unigram_entropy_nats"] if entropy is None else entropy
    return entropy


def vocab_from_checkpoint(load: str, config, tokenizer_vocab: int, tp: int):
    """The checkpoint decides the padded vocabulary (padding depends on the TP size it was
    trained with), so a run may resume under another TP size."""
    saved = read_state(resolve_checkpoint(load))["model_config"]["vocab_size"]
    if saved == config.vocab_size:
        return config
    if saved < tokenizer_vocab or saved % tp:
        raise ArgumentError(
            f"the checkpoint's vocabulary ({saved} rows) cannot serve this run: the tokenizer has {tokenizer_vocab} "
            f"tokens and TP {tp} needs a multiple of {tp}"
        )
    return config.replace(vocab_size=saved)


def dry_run_world(args: TrainArgs) -> int:
    """The world a dry run plans for: --dry-run N, else this launch's WORLD_SIZE, else 1."""
    world = args.dry_run or int(os.environ.get("WORLD_SIZE", "1"))
    if world < 1:
        raise ArgumentError(f"--dry-run {args.dry_run}: the number of ranks must be >= 1")
    return world


def dry_run(args: TrainArgs, notes: list[str]) -> Layout:
    """Checks the run for `dry_run_world(args)` ranks on the meta device, prints the layout and
    a summary, and returns the layout. Nothing is allocated and no process group is made."""
    import torch

    import dtmega
    from dtmega.models import Llama
    from dtmega.passes.render import layout_table
    from dtmega.printing import console

    world = dry_run_world(args)
    run = prepare_run(args, world)
    with torch.device("meta"):
        model = Llama(run.config)
    layout = dtmega.check_plan(model, run.shape.mesh_sizes(), run.plan)
    out = console()
    for note in notes:
        out.print(f"[dim]note: {note}[/dim]")
    mesh = " x ".join(f"{axis}={size}" for axis, size in layout.mesh.items() if size > 1) or "1 rank"
    out.print(layout_table(layout, title=f"dry run: {type(model).__name__} on {mesh}"))
    s = run.shape
    out.print(
        f"dry run for {world} ranks: {run.config.num_params():,} parameters, {layout.local_param_count():,} "
        f"({layout.local_bytes() / 2**30:.2f} GiB) on the first rank | PP {s.pp} x DP {s.dp} x CP {s.cp} x TP {s.tp}"
        + (f" (EP {s.ep})" if s.ep > 1 else "")
        + f" | global batch {s.global_batch} = micro {s.micro_batch} x DP {s.dp} x accumulation {s.accumulation}"
        f" | plan: {', '.join(p.name for p in run.plan.passes)}. Arguments, files and plan check out; nothing ran."
    )
    return layout
