"""What `dtmega train` decides before it touches a device: the run's shape, tokenizer, model
config and plan, from the arguments and the world size alone.

The trainer builds its run from `prepare_run`, and `dtmega train ... --dry-run [WORLD]` stops
right after it: the plan is annotated on a meta-device model for WORLD ranks (no process group,
no allocation), so a launch line for 64 GPUs is checked on a login node in seconds: flags,
config file, data and tokenizer files, divisibility of every parallel size, and the layout
with the bytes of parameters per rank.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from dtmega.data.indexed import IndexedDataset
from dtmega.data.tokenizers import Tokenizer, TokenizerSpec, build_tokenizer
from dtmega.data.vocab_check import check_data_ids
from dtmega.kernels.errors import DtmegaError
from dtmega.models.registry import ModelSpec, model_spec
from dtmega.passes import Layout, Plan, family_of
from dtmega.train.args import ArgumentError, TrainArgs
from dtmega.train.checkpoint import CheckpointError, read_state, select_checkpoint
from dtmega.train.checkpoint_paths import check_save_dir, fresh_start_note
from dtmega.train.eval_batch import eval_batch
from dtmega.train.run_data import RunData, plan_run_data
from dtmega.train.save_ownership import check_save_ownership
from dtmega.train.setup import (
    RunShape,
    build_plan,
    padded_vocab,
    plan_notes,
    reject_unsupported,
    run_shape,
    tiktoken_flag_notes,
    tokenizer_spec,
)


@dataclass
class RunPlan:
    """Everything about a run that is a pure function of its arguments and world size."""

    shape: RunShape
    tokenizer_spec: TokenizerSpec
    tokenizer: Tokenizer
    config: Any  # the model spec's config (a LlamaConfig for dtmega's Llama)
    plan: Plan
    unigram_entropy: float | None
    spec: ModelSpec
    args: TrainArgs  # the arguments as the run takes them (with what --auto-plan chose, --load dropped on a fresh start)
    data: RunData  # the splits as planned from the indices (the trainer builds them; a dry run stops before)
    notes: list[str] = field(default_factory=list)  # what start-up decided that the user should hear

    def build_model(self, seed: int):
        """The unsharded model to parallelize (on the meta device, or materialized by seed)."""
        return self.spec.instantiate(self.config, seed)

    @property
    def workload(self):
        """The step's per-rank shapes, as the plan was checked with and as the passes that choose
        kernels by measurement take them (sequence, micro-batch, compute dtype)."""
        return run_workload(self.args, self.shape)


def run_workload(args: TrainArgs, shape: RunShape):
    """The passes' Workload of a run: its sequence length, micro-batch, pipeline micro-batches and
    compute dtype."""
    from dtmega.passes import Workload

    return Workload(args.seq_length, shape.micro_batch, shape.accumulation if shape.pp > 1 else None,
                    args.compute_dtype)


SIZE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "num_experts")


def model_of(args: TrainArgs, tokenizer_vocab: int) -> tuple[ModelSpec, Any]:
    """(spec, config) of the model the arguments name: a model Megatron's flags size, of the
    family they select (dtmega/models/family.py: Llama; Qwen3 with --qk-layernorm; DeepSeek
    with --multi-latent-attention), or a registered size (`--model`) with the tokenizer's
    vocabulary and the flags its family still takes."""
    from dtmega.models import family_for_flags, model_family

    if args.load_hf:
        return hf_model_of(args)
    flagged = family_for_flags(args)
    if args.model is None:
        return model_spec(flagged.megatron.model), flagged.megatron.config(args, tokenizer_vocab)
    name = args.model
    try:
        spec = model_spec(name)
    except KeyError as error:
        raise ArgumentError(f"--model {name}: {error.args[0]}") from None
    if flagged.megatron.flag and flagged.name != spec.family:
        raise ArgumentError(f"--model {name} is a {spec.family} model; {flagged.megatron.flag} builds a {flagged.name} "
                            f"model. Fix: leave --model out (the flags size the model), or leave "
                            f"{flagged.megatron.flag} out")
    family = model_family(spec.family)
    if spec.size_flags:
        return spec, (family.megatron if family is not None and family.megatron else flagged.megatron).config(
            args, tokenizer_vocab)
    given = [f"--{flag.replace('_', '-')}" for flag in SIZE_FLAGS if getattr(args, flag)]
    if given:
        raise ArgumentError(f"--model {name} is a registered {spec.family} model whose sizes come from its spec; "
                            f"{', '.join(given)} cannot change them. Fix: leave them out, or register another size")
    config = spec.with_vocab(spec.config, padded_vocab(tokenizer_vocab, args))
    return spec, _named_size_flags(spec, config, args, f"--model {name}")


def _named_size_flags(spec: ModelSpec, config: Any, args: TrainArgs, source: str) -> Any:
    """The flags a model of fixed sizes (a named size, a Hugging Face checkpoint) still takes from
    its family (`MegatronSizing.adjust`, e.g. DeepSeek's --mtp-num-layers)."""
    from dtmega.models import model_family

    family = model_family(spec.family)
    if family is None or family.megatron is None or family.megatron.adjust is None:
        return config
    return family.megatron.adjust(config, args, source)


def hf_model_of(args: TrainArgs) -> tuple[ModelSpec, Any]:
    """`--load-hf`: the dtmega model of the Hugging Face architecture (Llama, Mixtral, DeepSeek-V3)
    with its config (every shard's header and
    the tokenizer checked now, before any process group or allocation). A tied model may be
    untied with --untie-embeddings-and-output-weights; its output layer then starts as the
    embedding (under pipeline parallelism a tied model stays tied, the last stage holding a copy)."""
    from dtmega.interop.hf_checkpoint import HFCheckpoint

    given = [f"--{flag.replace('_', '-')}" for flag in SIZE_FLAGS if getattr(args, flag)]
    if args.model or given:
        raise ArgumentError(f"--load-hf {args.load_hf}: the model's sizes come from its config.json; "
                            f"{', '.join(([f'--model {args.model}'] if args.model else []) + given)} cannot change "
                            "them. Fix: leave them out")
    from dtmega.train.setup import tokenizer_spec

    # the run's tokenizer (the directory's, or --tokenizer-type's), checked against the embedding
    checkpoint = HFCheckpoint.open(args.load_hf, tokenizer=build_tokenizer(tokenizer_spec(args)))
    config, spec = checkpoint.config, model_spec(checkpoint.model)
    if args.untie_embeddings_and_output_weights and config.tie_embeddings:
        config = config.replace(tie_embeddings=False)  # the output layer starts as a copy of the embedding
    depths = getattr(config, "mtp_num_layers", None)
    if args.mtp_num_layers is not None and args.mtp_num_layers != depths:
        held = f"holds {depths}" if depths is not None else "has none (not a DeepSeek model)"
        raise ArgumentError(f"--load-hf {args.load_hf} {held} multi-token-prediction layers; --mtp-num-layers "
                            f"{args.mtp_num_layers} would start {'some' if depths is not None else 'them'} from no weights. "
                            "Fix: leave --mtp-num-layers out (the checkpoint's layers are trained)")
    return spec, _named_size_flags(spec, config, args, f"--load-hf {args.load_hf}")


def layers_of(spec: ModelSpec, config: Any) -> int:
    """Number of transformer blocks, from the model family's facts (a meta-device build)."""
    if hasattr(config, "n_layers"):
        return config.n_layers
    with torch.device("meta"):
        model = spec.build(config)
    family = family_of(model)
    if family is None:
        raise ArgumentError(f"no model family knows {type(model).__name__} (model {spec.name}); "
                            "register one with dtmega.passes.register_family")
    return family.describe(model).n_layers


def prepare_run(args: TrainArgs, world: int) -> RunPlan:
    """Checks the arguments and files and derives the run; ArgumentError (the same on every
    rank) for anything that cannot run."""
    reject_unsupported(args)
    length = args.train_iters if args.train_samples is None else args.train_samples
    missing = [flag for flag, value in (("--train-iters (or --train-samples)", length), ("--lr", args.lr))
               if value is None]
    args.check_schedule()
    args.split_weights  # noqa: B018 (a --split that cannot be read fails the dry run as it fails the launch)
    if missing:
        raise ArgumentError(f"dtmega train needs {', '.join(missing)}")
    notes = args.check_data_source() + args.check_logging()
    token_spec = tokenizer_spec(args)
    tokenizer = build_tokenizer(token_spec)
    notes += tiktoken_flag_notes(args)
    if args.vocab_size is not None and token_spec.tokenizer_type not in ("NullTokenizer", "TikTokenizer"):
        notes.append(f"--vocab-size {args.vocab_size} is NullTokenizer's; --tokenizer-type {token_spec.tokenizer_type} "
                     f"has its own vocabulary of {tokenizer.vocab_size} ids, which this run uses (as Megatron does)")
    if args.auto_plan:
        from dtmega.train.auto_plan import apply_auto_plan

        args, note = apply_auto_plan(args, *model_of(args, tokenizer.vocab_size), world)
        notes.append(note)
    shape = run_shape(args, world)
    args.schedules(shape.global_batch)  # lengths that cannot make a schedule fail here, not after start-up
    args.total_steps(shape.global_batch)
    spec, config = model_of(args, tokenizer.vocab_size)
    fresh = fresh_start_note(args.load, args.save)
    if fresh is not None:
        notes.append(fresh)
        args = dataclasses.replace(args, load=None)
    if args.load:
        config = vocab_from_checkpoint(args.load, spec, config, tokenizer.vocab_size, shape.tp)
        try:
            check_resumed_schedule(args, shape.global_batch)
        except CheckpointError as refusal:
            if args.dry_run is None:
                raise
            # a dry run checks a launch days before it runs (as for --save's owner): said, not refused
            notes.append(f"today this launch would be refused: {refusal}")
    if args.sft:  # packed chat samples: their header, --seq-length and token ids checked now
        from dtmega.data.sft_dataset import check_sft_file

        for prefix in args.data_prefixes:
            check_sft_file(prefix, args.seq_length, tokenizer.vocab_size)
    else:
        for prefix in args.data_prefixes:
            IndexedDataset(prefix)  # a missing or malformed .bin/.idx fails here, naming the file
    entropy = None if args.sft else check_data_vocab(args, tokenizer.vocab_size)
    data = plan_run_data(args, shape.global_batch)  # every split the launch builds, refused here as there
    notes += data.notes
    plan = build_plan(args, shape, layers_of(spec, config))
    eval_batch(args, shape, plan)  # --eval-global-batch-size over the data-parallel ranks and the schedule
    notes += plan_notes(args, shape)
    if data.validates:
        notes += validation_cost_note(args, args.total_steps(shape.global_batch))
    parameters = check_before_launch(spec, config, shape, plan, args)
    check_outputs(args)
    if args.save:
        notes += save_ownership_notes(args)
        warning = check_save_dir(args.save, parameters, create=args.dry_run is None)
        notes += [warning] if warning else []
    return RunPlan(shape, token_spec, tokenizer, config, plan, entropy, spec, args, data, notes)


def check_outputs(args: TrainArgs) -> None:
    """--log-file, --tensorboard-dir, --data-cache-path and W&B's directory can be written (their
    directory made and probed, as the run will do; a dry run checks the nearest existing
    ancestor only): before, /proc/m.jsonl or a directory under a file failed after the process
    group, with the raw OS error."""
    from pathlib import Path

    from dtmega.writable import existing_ancestor, make_writable_dir

    for flag, value, directory in (("--log-file", args.log_file, False), ("--tensorboard-dir", args.tensorboard_dir, True),
                                   ("--data-cache-path", args.data_cache_path, True),
                                   ("--wandb-save-dir", args.wandb_dir, True)):
        if not value:
            continue
        target = Path(value) if directory else Path(value).parent
        fix = f"Fix: pass a {flag} {'directory' if directory else 'file'} on a writable filesystem"
        if not directory and Path(value).is_dir():
            raise ArgumentError(f"{flag} {value} is a directory; it takes a file name (metrics.jsonl). {fix}")
        if args.dry_run is not None:
            ancestor = existing_ancestor(target)
            if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
                raise ArgumentError(f"{flag} {value}: {ancestor} is not a writable directory. {fix}")
            continue
        try:
            make_writable_dir(target)
        except OSError as error:
            raise ArgumentError(f"{flag} {value}: cannot write there ({error.strerror}: {error.filename}). {fix}") from None


def validation_cost_note(args: TrainArgs, steps: int) -> list[str]:
    """A start-up line when validation is a noticeable share of the run's compute (Megatron's
    default --eval-iters 100 after a short fine-tune ran four times longer than the training):
    how many validations, of how many batches, and what that costs."""
    no_validation = args.per_split_paths is not None and not args.valid_data_path
    if args.eval_iters <= 0 or steps <= 0 or no_validation:
        return []
    count = (steps - 1) // args.eval_interval + 1  # every --eval-interval steps before the last, and the final one
    share = count * args.eval_iters / 3 / steps  # a forward-only batch is about a third of a training step
    if share < 0.1:
        return []
    return [f"validation will cost about {share:.0%} of the training's compute: {count} validation(s) of --eval-iters "
            f"{args.eval_iters} global batches (forward only, about a third of a step each; a progress line while "
            "each runs; the final checkpoint is saved before the last one). Fix, if that is more than you want: a "
            "smaller --eval-iters or a larger --eval-interval"]


def save_ownership_notes(args: TrainArgs) -> list[str]:
    """`--save` checked against the checkpoints it holds (save_ownership.py): a run never
    clobbers another's, nor moves `latest` back, unless --overwrite-checkpoints says so."""
    loaded, state = None, None
    if args.load:
        loaded = select_checkpoint(args.load, contents=False)[0]
        state = read_state(loaded)
    try:
        return check_save_ownership(args.save, loaded, state, args.overwrite_checkpoints, load_arg=args.load)
    except CheckpointError as refusal:
        if args.dry_run is None:
            raise
        # a dry run checks a launch days before it runs (as for --save's room): said, not refused
        return [f"today this launch would be refused: {refusal}"]


def check_before_launch(spec: ModelSpec, config: Any, shape: RunShape, plan: Plan, args: TrainArgs) -> int:
    """Annotates the whole plan on a meta-device model for this world and these step shapes, so
    every plan error (divisibility, kernels or backends this machine lacks, sequence lengths)
    stops the run before any process group, data or device is touched. Returns the model's
    parameter count."""
    import dtmega
    from dtmega.mesh import default_device_type
    from dtmega.train.memory_fit import check_weights_fit

    if args.dry_run is None:  # before the meta build, which a model of 10^6 layers makes slow
        check_weights_fit(config, shape.world, 4, default_device_type())  # fp32 master weights in every mode
    with torch.device("meta"):
        model = spec.build(config)
    workload = run_workload(args, shape)
    try:
        dtmega.check_plan(model, shape.mesh_sizes(), plan, workload=workload)
    except dtmega.PlanError as error:  # the fix in the user's terms: flags, not the Python API's arguments
        error.args = (in_flag_terms(str(error)),)
        raise
    return sum(parameter.numel() for parameter in model.parameters())


# A pass's fix written for the Python API, and the same fix on the command line.
FLAG_SPELLINGS = {
    "Float8(backend='transformer_engine')": "--transformer-impl transformer_engine",
    "Float8(backend='dtmega')": "--transformer-impl local",
    "backend='dtmega'": "--transformer-impl local (dtmega's own FP8 linear)",
}


# the passes' and configs' names of sizes, as the flags that set them (applied in this order)
FIELD_SPELLINGS = (
    (r"use tp in \[([0-9, ]+)\]", r"--tensor-model-parallel-size one of \1"),
    (r"\btp=(\d+)", r"--tensor-model-parallel-size \1"),
    (r"\bcp=(\d+)", r"--context-parallel-size \1"),
    (r"\bep=(\d+)", r"--expert-model-parallel-size \1"),
    (r"\bn_heads=(\d+)", r"--num-attention-heads \1"),
    (r"\bn_kv_heads=(\d+)", r"--num-query-groups \1"),
    (r"\bnum_experts=(\d+)", r"--num-experts \1"),
    (r"\bffn_dim=(\d+)", r"--ffn-hidden-size \1"),
    (r"\bvocab_size=(\d+)", r"--padded-vocab-size \1"),
    (r"method='ring' or 'all_gather'", "--cp-comm-type p2p or all_gather"),
)


def in_flag_terms(message: str) -> str:
    """A plan error's message with the Python API's spellings replaced by the trainer's flags (an
    FP8 backend is `--transformer-impl`, not `backend=`; heads are `--num-attention-heads`, not
    `n_heads=`), so that the fix it names is one to type on the command line."""
    for python, flag in FLAG_SPELLINGS.items():
        message = message.replace(python, flag)
    for pattern, flag in FIELD_SPELLINGS:
        message = re.sub(pattern, flag, message)
    return message


def check_data_vocab(args: TrainArgs, vocab_size: int) -> float | None:
    """Fails if a dataset holds ids this run's tokenizer does not have (`vocab_size` is the
    tokenizer's own size, not the model's padded one; data/vocab_check.py, with or without the
    `.stats.json` sidecar); returns the (first) dataset's unigram entropy when recorded."""
    entropy = None
    for prefix in args.data_prefixes:  # none with --mock-data
        found = check_data_ids(prefix, vocab_size)
        entropy = found if entropy is None else entropy
    return entropy


def check_resumed_schedule(args: TrainArgs, global_batch: int) -> None:
    """A resume whose schedule flags differ from the checkpoint's is refused before any process
    group (Megatron's scheduler check; the trainer applies the same rule when it loads)."""
    if args.finetune or args.no_load_optim:
        return  # a fresh schedule, as Megatron's (its scheduler is loaded with the optimizer)
    from dtmega.train.schedule import resumed_schedule

    saved = read_state(select_checkpoint(args.load, contents=False)[0]).get("schedule")
    try:
        resumed_schedule(args.schedules(global_batch), saved, args.override_opt_param_scheduler,
                         args.use_checkpoint_opt_param_scheduler)
    except (TypeError, KeyError) as error:  # a state.json edited by hand, or of another version
        raise CheckpointError(f"--load {args.load}: its recorded learning-rate schedule cannot be read ({error}). "
                              "Fix: --override-opt_param-scheduler (follow this launch's flags)") from None
    except DtmegaError as error:
        raise CheckpointError(f"--load {args.load}: {error}") from None


def vocab_from_checkpoint(load: str, spec: ModelSpec, config, tokenizer_vocab: int, tp: int):
    """The checkpoint decides the padded vocabulary (padding depends on the TP size it was
    trained with), so a run may resume under another TP size. The checkpoint is the one loading
    will pick (a damaged `latest` falls back; files checked by size here, by checksum at load)."""
    checkpoint = select_checkpoint(load, contents=False)[0]
    saved = read_state(checkpoint)["model_config"]["vocab_size"]
    if saved == config.vocab_size:
        return config
    if saved < tokenizer_vocab or saved % tp:
        raise ArgumentError(
            f"the checkpoint's vocabulary ({saved} rows, {checkpoint}) cannot serve this run: the tokenizer has "
            f"{tokenizer_vocab} tokens and TP {tp} needs a multiple of {tp}. Fix: resume with the tokenizer the "
            f"checkpoint was trained with (its state.json names it) and a --tensor-model-parallel-size that divides "
            f"{saved}"
        )
    return spec.with_vocab(config, saved)


def dry_run_world(args: TrainArgs) -> int:
    """The world a dry run plans for: --dry-run N, else this launch's WORLD_SIZE, else 1."""
    world = args.dry_run or int(os.environ.get("WORLD_SIZE", "1"))
    if world < 1:
        raise ArgumentError(f"--dry-run {args.dry_run}: the number of ranks must be >= 1")
    return world


def model_title(config: Any, model: torch.nn.Module) -> str:
    """How the dry run names the model: its class, and for a mixture of experts how many experts
    and how many each token takes (a Mixtral line is "Llama with a mixture of experts (8 experts,
    top-2)", not just "Llama")."""
    name = type(model).__name__
    moe = getattr(config, "moe", None)
    if moe is None:
        return name
    shared = f", a shared expert of width {moe.shared_expert_ffn_dim}" if moe.shared_expert_ffn_dim else ""
    return f"{name} with a mixture of experts ({moe.num_experts} experts, top-{moe.top_k}{shared})"


def dry_run(args: TrainArgs, notes: list[str]) -> Layout:
    """Checks the run for `dry_run_world(args)` ranks on the meta device, prints the layout and
    a summary, and returns the layout. Nothing is allocated and no process group is made."""
    import dtmega
    from dtmega.passes.render import layout_table
    from dtmega.printing import console

    world = dry_run_world(args)
    run = prepare_run(args, world)
    with torch.device("meta"):  # a dry run never materializes weights, whatever the spec does
        model = run.spec.build(run.config)
    layout = dtmega.check_plan(model, run.shape.mesh_sizes(), run.plan)
    out = console()
    for note in [*notes, *run.notes]:
        out.print(f"[dim]note: {note}[/dim]")
    mesh = " x ".join(f"{axis}={size}" for axis, size in layout.mesh.items() if size > 1) or "1 rank"
    out.print(layout_table(layout, title=f"dry run: {model_title(run.config, model)} on {mesh}"))
    s = run.shape
    out.print(
        f"dry run for {world} ranks: {layout.global_param_count():,} parameters, {layout.local_param_count():,} "
        f"({layout.local_bytes() / 2**30:.2f} GiB) on the first rank | PP {s.pp} x DP {s.dp} x CP {s.cp} x TP {s.tp}"
        + (f" (EP {s.expert_parallel}" + (": ETP 1, folded over TP)" if s.expert_fold > 1 else ")")
           if s.expert_parallel > 1 else "")
        + f" | global batch {s.global_batch} = micro {s.micro_batch} x DP {s.dp} x accumulation {s.accumulation}"
        f" | plan: {', '.join(p.name for p in run.plan.passes)}. Arguments, files and plan check out; nothing ran."
    )
    return layout
