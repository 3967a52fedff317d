"""From arguments to a run: validated sizes, the model config, the mesh shape and the plan.

Everything here is a pure function of the arguments, the world size and the tokenizer, so it
runs identically on every rank and every bad combination fails before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dtmega.data.tokenizers import TokenizerSpec
from dtmega.passes import Plan
from dtmega.train.args import ArgumentError, TrainArgs
from dtmega.train.model_flags import MOE_FLAGS, model_config, moe_config, padded_vocab  # noqa: F401  (setup's names)
from dtmega.train.not_built import refuse_not_built
from dtmega.train.plan_file import compose_plan


@dataclass(frozen=True)
class RunShape:
    """How the world is used and how a global batch is cut."""

    world: int
    tp: int
    pp: int
    cp: int
    dp: int  # data-parallel ranks (the batch splits over them), ep included
    dp_replicate: int
    dp_shard: int
    ep: int
    micro_batch: int
    global_batch: int
    accumulation: int
    expert_fold: int = 1  # TP ranks the experts are also spread over, whole (ETP 1 folding); EP = ep x this

    @property
    def expert_parallel(self) -> int:
        """Megatron's --expert-model-parallel-size: the ranks one layer's experts are spread over."""
        return self.ep * self.expert_fold

    def mesh_sizes(self) -> dict[str, int]:
        """The mesh this run needs, as `dtmega.make_mesh` keyword arguments."""
        return dict(pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, ep=self.ep, cp=self.cp,
                    tp=self.tp)


def reject_unsupported(args: TrainArgs) -> None:
    """Flags whose feature does not exist (yet), and flags that contradict each other, with what
    to do instead."""
    refuse_not_built(args)
    if args.bf16 and args.fp16:
        raise ArgumentError("--bf16 and --fp16 are exclusive; choose one")
    loading = [f"--{name.replace('_', '-')}" for name in ("finetune", "no_load_optim", "no_load_rng")
               if getattr(args, name)]
    if loading and not args.load:
        raise ArgumentError(f"{', '.join(loading)} say(s) how to load --load, which is not given. Fix: add --load "
                            "CHECKPOINT_DIR (a Hugging Face model is loaded weights-only by --load-hf already)")
    retain, every = args.save_retain_interval, args.save_interval or 1
    if retain is not None and retain % every:
        raise ArgumentError(f"--save-retain-interval {retain} is not a multiple of --save-interval {every}, so no "
                            f"checkpoint would be kept at it. Fix: a multiple of {every}, e.g. "
                            f"{every * max(1, retain // every)}")
    if args.save_hf and not args.save:
        raise ArgumentError("--save-hf writes the run's final checkpoint as a Hugging Face model: it needs --save")
    if args.save_hf and Path(args.save_hf).is_dir() and any(Path(args.save_hf).iterdir()):
        raise ArgumentError(f"--save-hf {args.save_hf} holds files; the export never overwrites. Fix: a new directory, "
                            "or remove that one first")


def _has_experts(args: TrainArgs) -> bool:
    """Whether the run's model has MoE layers: Megatron's --num-experts, a registered model
    whose sizes come from its spec (e.g. --model deepseek-debug) with an MoE config, or a
    --load-hf model whose config.json has experts (Mixtral's, DeepSeek-V3's)."""
    if args.num_experts:
        return True
    if args.load_hf:
        from pathlib import Path

        from dtmega.safe_files import read_regular_json

        try:
            config = read_regular_json(Path(args.load_hf) / "config.json", "config.json of the model")
        except (OSError, ValueError):
            return False  # --load-hf's own checks name the problem
        return isinstance(config, dict) and bool(config.get("num_local_experts") or config.get("n_routed_experts"))
    if args.model is None:
        return False
    from dtmega.models.registry import model_spec

    try:
        spec = model_spec(args.model)
    except KeyError:
        return False
    return not spec.size_flags and getattr(spec.config, "moe", None) is not None


def run_shape(args: TrainArgs, world: int) -> RunShape:
    """Data-parallel size, batch split and accumulation; ArgumentError for sizes that do not fit."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if tp < 1 or pp < 1 or cp < 1 or world % (tp * pp * cp):
        raise ArgumentError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} x --context-parallel-size {cp} "
            f"does not divide the world size {world}"
        )
    dp = world // (tp * pp * cp)
    micro, counted = args.micro_batch_size, args.microbatches
    global_batch = args.global_batch_size
    if counted is not None and micro is None:
        if global_batch is None or global_batch % (dp * counted):
            raise ArgumentError(
                f"--microbatches {counted} needs --global-batch-size divisible by {counted} x data-parallel size {dp}"
            )
        micro = global_batch // (dp * counted)
    micro = micro or 1
    if micro < 1:
        raise ArgumentError(f"--micro-batch-size must be >= 1, got {micro}")
    global_batch = global_batch or micro * dp * (counted or 1)
    if global_batch % (micro * dp):
        raise ArgumentError(
            f"--global-batch-size {global_batch} is not divisible by --micro-batch-size {micro} x data-parallel "
            f"size {dp} (= {micro * dp}). Fix: use a multiple of {micro * dp}, e.g. "
            f"{max(1, global_batch // (micro * dp)) * micro * dp}"
        )
    if counted is not None and counted != global_batch // (micro * dp):
        raise ArgumentError(
            f"--microbatches {counted} disagrees with --global-batch-size {global_batch} / (--micro-batch-size {micro} "
            f"x data-parallel size {dp}) = {global_batch // (micro * dp)}; give one of them"
        )
    ep, fold = args.expert_model_parallel_size, expert_fold(args)
    if fold > 1:
        ep //= fold  # the rest of EP's ranks come from data parallelism
    if ep < 1 or dp % ep:
        raise ArgumentError(
            f"--expert-model-parallel-size {ep}: expert parallelism borrows data-parallel ranks, and the data-parallel "
            f"size is {dp} (world {world} / (TP {tp} x PP {pp} x CP {cp})). Fix: an EP size that divides {dp}"
        )
    if ep > 1 and not _has_experts(args):
        raise ArgumentError("--expert-model-parallel-size > 1 needs a mixture-of-experts model (--num-experts, or a "
                            "--model with experts)")
    mode = args.data_parallel_mode()
    shard = dp
    replicate = 1
    if mode == "ddp":
        replicate, shard = dp, 1
    elif mode == "hsdp":
        instances = args.num_distributed_optimizer_instances
        shard = args.data_parallel_shard_size or (dp // instances if instances > 1 and dp % instances == 0 else 0)
        if instances > 1 and (dp % instances or (args.data_parallel_shard_size not in (None, dp // instances))):
            raise ArgumentError(
                f"--num-distributed-optimizer-instances {instances} must divide the data-parallel size {dp} (each "
                f"instance shards over {dp} / {instances} ranks), and agree with --data-parallel-shard-size if given"
            )
        if shard < 1 or dp % shard or shard == dp or shard % ep:
            raise ArgumentError(
                f"--data-parallel hsdp needs --data-parallel-shard-size dividing the data-parallel size {dp} "
                f"(and smaller than it), and divisible by --expert-model-parallel-size {ep}"
            )
        replicate = dp // shard
    # The mesh's ep axis is carved out of the data-parallel ranks that shard (or replicate).
    if mode == "ddp":
        replicate //= ep
    else:
        shard //= ep
    return RunShape(world, tp, pp, cp, dp, replicate, shard, ep, micro, global_batch, global_batch // (micro * dp), fold)


def expert_fold(args: TrainArgs) -> int:
    """How many tensor-parallel ranks the experts are spread over whole (Megatron's MoE parallel
    folding with --expert-tensor-parallel-size 1): TP when EP reaches over them, else 1. With
    ETP 1 and EP below TP the experts stay whole and replicated over TP (TensorParallel leaves
    them alone); EP neither below TP nor a multiple of it is refused."""
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    if args.expert_tensor_parallel_size != 1 or tp == 1 or not _has_experts(args) or ep == 1:
        return 1
    if ep % tp:
        raise ArgumentError(
            f"--expert-tensor-parallel-size 1 with --expert-model-parallel-size {ep} and --tensor-model-parallel-size "
            f"{tp}: the experts are spread whole over EP ranks that take in all {tp} TP ranks of a group (Megatron's "
            f"folding); {ep} is not a multiple of {tp}. Fix: an EP that is a multiple of {tp}, or EP 1 (experts whole "
            "on every TP rank)"
        )
    return tp


def plan_notes(args: TrainArgs, shape: RunShape) -> list[str]:
    """What the plan leaves out of what the flags ask for, as Megatron warns of it."""
    notes = []
    if args.sequence_parallel and shape.tp == 1:
        notes.append("--sequence-parallel with --tensor-model-parallel-size 1: sequence parallelism is off (it splits "
                     "what tensor parallelism replicates; Megatron turns it off the same way)")
    etp = args.expert_tensor_parallel_size
    if not args.num_experts and etp not in (None, shape.tp):
        notes.append(f"--expert-tensor-parallel-size {etp} without --num-experts: the model has no experts, so it splits "
                     "nothing (Megatron builds its expert groups and uses none)")
    return notes


def build_plan(args: TrainArgs, shape: RunShape, n_layers: int) -> Plan:
    """The pass sequence the flags ask for: each section of the arguments contributes its passes
    (dtmega/train/args.py), in plan order; then the passes of one's own (--plan, or --config's
    [[passes]]) in the places their declarations give them (plan_file.py). The dry run, the
    launch, the ranks' agreement check and the checkpoint's record all take this plan."""
    refuse_not_built(args)
    flag_built = [*args.split_passes(shape, n_layers), *args.pipeline_passes(shape, n_layers), *args.document_passes(),
                  *args.fusion_passes(), *args.attention_passes(), *args.fp8_passes(),
                  *args.data_parallel_passes(args.compute_dtype)]
    return Plan(compose_plan(flag_built, args.custom_plan()))


def tokenizer_spec(args: TrainArgs) -> TokenizerSpec:
    """The tokenizer the data was prepared with."""
    if args.load_hf:  # a Hub id is named as one, not as a missing tokenizer file
        from dtmega.interop.local_model import require_local_dir

        require_local_dir(args.load_hf, "--load-hf")
    if args.tokenizer_type is None and args.load_hf:  # the model's own tokenizer
        return TokenizerSpec("HuggingFaceTokenizer", args.tokenizer_model or args.load_hf, eod_token=args.eod_token)
    if args.tokenizer_type is None:
        raise ArgumentError("--tokenizer-type is required (the one the data was preprocessed with)")
    sized = args.tokenizer_type in ("NullTokenizer", "TikTokenizer")  # --vocab-size is theirs (Megatron ignores it elsewhere)
    if args.tokenizer_type != "TikTokenizer":
        return TokenizerSpec(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file, args.eod_token,
                             args.vocab_size if sized else None)
    special = tuple(args.tiktoken_special_tokens) if args.tiktoken_special_tokens else None
    return TokenizerSpec(args.tokenizer_type, args.tokenizer_model, eod_token=args.eod_token, vocab_size=args.vocab_size,
                         tiktoken_pattern=args.tiktoken_pattern, tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
                         tiktoken_special_tokens=special)


def tiktoken_flag_notes(args: TrainArgs) -> list[str]:
    """The TikTokenizer flags on a line with another --tokenizer-type mean nothing, as in Megatron
    (its Llama-3 FP8 example passes --tiktoken-pattern v2 with NullTokenizer): a note says so."""
    if args.tokenizer_type == "TikTokenizer":
        return []
    given = [flag for flag, value, default in (("--tiktoken-pattern", args.tiktoken_pattern, None),
                                               ("--tiktoken-num-special-tokens", args.tiktoken_num_special_tokens, 1000),
                                               ("--tiktoken-special-tokens", args.tiktoken_special_tokens, None))
             if value != default]
    if not given:
        return []
    return [f"{', '.join(given)} configure(s) --tokenizer-type TikTokenizer; --tokenizer-type {args.tokenizer_type} "
            "does not read them (as in Megatron)"]
