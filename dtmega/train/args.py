"""`dtmega train` arguments: Megatron-LM's `pretrain_gpt.py` flags, a TOML config, or both.

Precedence: built-in defaults < the TOML's `model` preset < `--config` TOML < `--model` on the command
line < flags on the command line.
Every flag does something, is rejected as "not supported yet", or is accepted with a one-line
note saying why it means nothing here. Nothing is silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtmega.passes.toml_io import load_toml
from dtmega.train.arg_checks import (
    OptionValueError,
    check_ranges,
    check_toml_types,
    flag_of,
)
from dtmega.train.arg_fields import ArgumentError
from dtmega.train.arg_fields import opt as _opt
from dtmega.train.checkpoint_args import CheckpointArgs
from dtmega.train.data_args import DataArgs
from dtmega.train.fp8_args import FP8Args
from dtmega.train.fusion_args import FusionArgs
from dtmega.train.logging_args import LoggingArgs
from dtmega.train.megatron_only_args import MegatronOnlyArgs
from dtmega.train.model_args import ModelArgs
from dtmega.train.moe_args import MoEArgs
from dtmega.train.optimizer_args import OptimizerArgs
from dtmega.train.parallel_args import ParallelArgs
from dtmega.train.pipeline_args import PipelineArgs
from dtmega.train.plan_args import PlanArgs, config_passes

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class LaunchArgs:
    """Checking a launch before it runs."""

    dry_run: int | None = _opt(None, "check the run for N ranks (default: this launch's) on no device: arguments, "
                                     "files, plan and layout; print it and exit")

@dataclass(frozen=True)
class TrainArgs(LaunchArgs, MegatronOnlyArgs, LoggingArgs, CheckpointArgs, DataArgs, OptimizerArgs, MoEArgs,
                FP8Args, FusionArgs, PipelineArgs, PlanArgs,
                ParallelArgs, ModelArgs):
    """All options of a training run (flag --foo-bar is field foo_bar), in sections that each own
    their fields and their range checks (the bases, listed last-first so fields keep the order
    model, parallel, pipeline, ...). Immutable: what is derived later (the plan --auto-plan
    picks, a start without a checkpoint) is a new value (`dataclasses.replace`)."""


# Megatron flags that mean nothing here: accepted, with the reason.
NOTED_FLAGS = {
    "check_for_nan_in_loss_and_grad": "on by default here (--no-check-for-nan-in-loss-and-grad turns it off; "
                                      "--max-skipped-steps bounds the streak)",
    "use_mcore_models": "dtmega has one model implementation",
    "rotary_interleaved": "dtmega's RoPE rotates adjacent channel pairs (Meta's layout), which is what this flag asks "
                          "of Megatron (without it Megatron rotates each head's halves: the same model up to a fixed "
                          "permutation of the query/key channels, which `dtmega convert megatron-to-dtmega` undoes "
                          "unless given --rotary-interleaved)",
    "use_flash_attn": "attention uses torch's scaled_dot_product_attention, which picks flash kernels itself",
    "no_masked_softmax_fusion": "attention runs torch's fused SDPA kernels (causal masking inside them)",
    "no_persist_layer_norm": "Apex's persistent LayerNorm does not exist here; --no-rms-norm-fusion turns dtmega's "
                             "RMSNorm kernel off",
    "no_gradient_accumulation_fusion": "Megatron fuses weight-gradient accumulation into its GEMMs (Apex/TE); here "
                                       "FSDP/DDP accumulate gradients between micro-batches in the reduce dtype",
    "distributed_backend": "the backend follows the device (nccl on CUDA, gloo on CPU)",
    "fp8_interval": "Transformer Engine deprecated it: scales are updated every step, as there",
    "num_workers": "batches are read from memory-mapped .bin files in the training process itself; there are no "
                   "loader workers to size",
    "overlap_grad_reduce": "DDP and FSDP2 overlap the gradient reduction with the backward pass by default (DDP's "
                           "buckets, FSDP2's reduce-scatter per block)",
    "overlap_param_gather": "FSDP2 prefetches the next block's all-gather while the current block computes, by "
                            "default",
    "accumulate_allreduce_grads_in_fp32": "gradients are always reduced in fp32 here (DataParallel's reduce dtype), "
                                          "with --bf16 too",
    "no_bias_dropout_fusion": "the GPT blocks' bias, dropout and residual add run as separate torch ops (no fused "
                              "kernel to turn off)",
    "use_rotary_position_embeddings": "RoPE is the position embedding here (--position-embedding-type rope, the "
                                      "default)",
    "use_dist_ckpt": "checkpoints are always sharded torch.distributed.checkpoint directories (Megatron's torch_dist "
                     "is DCP too; `dtmega convert` reads Megatron's)",
    "no_create_attention_mask_in_dataloader": "the data loader never builds an attention mask: attention is causal "
                                              "inside the kernels",
    "log_throughput": "every log line (and TensorBoard) carries tokens_per_s and tflops_per_device",
    "log_validation_ppl_to_tensorboard": "validation perplexity is always written to TensorBoard (valid/val_ppl)",
    "log_memory_to_tensorboard": "memory_gib is written to TensorBoard at every log step",
    "no_position_embedding": "Megatron's deprecated switch of its legacy model; Megatron-Core's GPT (and dtmega) "
                             "follow --position-embedding-type",
    "auto_detect_ckpt_format": "dtmega reads its own checkpoints by their state.json (`dtmega convert` reads "
                               "Megatron's)",
    "enable_experimental": "dtmega has no experimental switch: each feature it has is on by its own flag",
    "init_model_with_meta_device": "the model is always built on the meta device and initialized shard by shard",
    "attention_softmax_in_fp32": "torch's attention kernels already compute the softmax in fp32 for bf16/fp16 "
                                 "inputs",
    "legacy_tokenizer": "dtmega has one tokenizer implementation per --tokenizer-type",
    "rerun_mode": "dtmega has no re-run engine: a non-finite step is skipped and counted (--max-skipped-steps stops a "
                  "streak), and --check-for-spiky-loss re-runs a spiking step once to tell data from a transient fault",
    "use_cpu_initialization": "the model is built on the meta device and each rank initializes only its own shards "
                              "(the values of an unsharded init), so no rank ever holds a full copy",
    # checkpoint I/O strategies of Megatron's dist-checkpointing: DCP here does each of them itself
    "use_persistent_ckpt_worker": "Megatron keeps one writer process alive instead of forking one per --async-save; "
                                  "dtmega's --async-save writes from a thread of the training process (DCP's "
                                  "async_save), so there is no process to fork or keep",
    "dist_ckpt_optim_fully_reshardable": "the optimizer state is always saved as DTensors in DCP, which any later "
                                         "TP/PP/DP/FSDP layout reads back (tests/distributed/test_training.py "
                                         "resumes across plans)",
    "ckpt_fully_parallel_save": "DCP's save planner always spreads the writes of replicated shards over the ranks "
                                "holding them",
    "no_ckpt_fully_parallel_save": "only changes which rank writes a replicated shard: DCP's planner spreads them "
                                   "over the ranks holding them",
    "ckpt_fully_parallel_load": "each rank reads only its own shards from the DCP directory",
    "ckpt_assume_constant_structure": "a speed hint (reuse the save plan between saves); DCP plans each save afresh, "
                                      "which writes the same checkpoint",
    "async_strategy": "Megatron's choice of asynchronous-save engine (nvrx or mcore); --async-save here is DCP's "
                      "async_save, one engine",
    "async_ckpt_use_cpu_shm": "Megatron's staging of --async-save copies in shared memory for its writer process; "
                              "DCP's async_save stages in this process's host memory",
    "verify_integrity": "every dtmega checkpoint holds a manifest of each file's size and CRC-32, verified at every "
                        "load (a damaged checkpoint is named and an older intact one used: docs/checkpoints.md)",
    "use_tp_pp_dp_mapping": "Megatron's order of ranks in its groups (TP, PP, then DP); dtmega's mesh orders them as "
                            "dtmega.make_mesh does (PP outermost, TP innermost): which ranks share a group changes, "
                            "not what any rank computes",
    "ddp_average_in_collective": "gradients are averaged over the data-parallel ranks by the reduction itself here "
                                 "(FSDP2's reduce-scatter and DDP's all-reduce average), the same mean",
    "apply_query_key_layer_scaling": "Megatron divides Q·Kᵀ by the layer number and multiplies it back inside an fp32 "
                                     "softmax (for fp16 range): the same probabilities; torch's attention kernels "
                                     "keep the scores in fp32 already",
}
_NOTED_WITH_VALUE = {"distributed_backend", "num_workers", "fp8_interval", "rerun_mode", "async_strategy"}

def _base_type(annotation: str) -> type:
    text = str(annotation)
    for name, kind in (("list", list), ("bool", bool), ("int", int), ("float", float)):
        if text.startswith(name) or text.startswith(f"{name} |"):
            return kind
    return str


class _Parser(argparse.ArgumentParser):
    """argparse, whose errors are one line with the closest known flags instead of the whole
    usage (which lists some 150 flags), and which reads `-1e-3` as a number, as it reads
    `-0.001` (argparse's own pattern has no exponent, so `--lr -1e-3` was "expected one argument")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message: str):  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):  # Megatron flags of features not built: their rows
            from dtmega.train.not_built import unparsed_refusal

            refusal = unparsed_refusal(message.split(":", 1)[1].split())
            if refusal is not None:
                raise ArgumentError(refusal)
        known = [option for action in self._actions for option in action.option_strings if option.startswith("--")]
        guesses = []
        for word in message.replace(",", " ").split():
            word = word.rstrip(":;.")  # "argument --tokenizer-type: invalid choice" names a known flag
            if word.startswith("--") and word not in known:
                name = word.split("=", 1)[0]
                close = [guess for guess in difflib.get_close_matches(name, known, n=5, cutoff=0.6)
                         if _same_first_word(name, guess)][:3]
                if close:
                    guesses.append(f"{name}: did you mean {' or '.join(close)}?")
        hint = f" ({'; '.join(guesses)})" if guesses else ""
        fix = "pass one of the choices listed" if "invalid choice" in message else "`dtmega train --help` lists every flag"
        raise ArgumentError(f"{message}{hint}. Fix: {fix}")


def _same_first_word(flag: str, guess: str) -> bool:
    """A guess for a mistyped flag must name the same thing: its first word is the flag's (up to
    a typo). `--ckpt-format` is not `--fp8-format`, nor `--decoupled-lr` `--compile`."""
    first = flag.removeprefix("--").split("-", 1)[0]
    other = guess.removeprefix("--").split("-", 1)[0]
    return difflib.SequenceMatcher(None, first, other).ratio() >= 0.75


def build_parser() -> argparse.ArgumentParser:
    """The `dtmega train` argument parser (every default suppressed, to see what was given)."""
    parser = _Parser(
        prog="dtmega train", argument_default=argparse.SUPPRESS,
        description="Pretrain a Llama with a parallel plan; flags follow Megatron-LM's pretrain_gpt.py.",
    )
    parser.add_argument("--config", type=Path, help="TOML file of options (keys are flag names)")
    for f in fields(TrainArgs):
        kind = _base_type(f.type)
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if default not in (None, False, []):
            help_text += f" (default: {default})".replace("%", "%%")
        names = [flag_of(f.name), *f.metadata.get("aliases", ())]
        if f.name == "dry_run":
            parser.add_argument(*names, type=int, nargs="?", const=0, metavar="WORLD", help=help_text)
        elif kind is bool:
            parser.add_argument(*names, action="store_true", help=help_text)
        elif kind is list:
            parser.add_argument(*names, nargs="+", help=help_text)
        else:
            parser.add_argument(*names, type=kind, choices=f.metadata.get("choices"), help=help_text)
    for name in NOTED_FLAGS:
        if name in _NOTED_WITH_VALUE:
            parser.add_argument(flag_of(name), help=f"accepted, no effect: {NOTED_FLAGS[name]}")
        else:
            parser.add_argument(flag_of(name), action="store_true", help=f"accepted, no effect: {NOTED_FLAGS[name]}")
    return parser


def _preset(name: str) -> dict[str, Any]:
    from dtmega.models.registry import model_names, model_spec

    try:
        spec = model_spec(name)
    except KeyError:
        raise ArgumentError(
            f"--model {name!r} is unknown; choose one of {', '.join(model_names())}, or register your own "
            "(dtmega.models.register_model) in a module passed with --custom-import"
        ) from None
    if not spec.size_flags:
        return {}  # its sizes come from its spec, not from Megatron's size flags
    c = spec.config
    preset = {
        "num_layers": c.n_layers, "hidden_size": c.dim, "ffn_hidden_size": c.ffn_dim,
        "num_attention_heads": c.n_heads, "group_query_attention": c.n_kv_heads != c.n_heads,
        "num_query_groups": c.n_kv_heads, "rotary_base": c.rope_theta, "use_rope_scaling": c.rope_scaling is not None,
        "norm_epsilon": c.norm_eps, "swiglu": True, "untie_embeddings_and_output_weights": not c.tie_embeddings,
        # the Llama block in Megatron's flags (their defaults are GPT blocks')
        "normalization": "RMSNorm", "position_embedding_type": "rope", "disable_bias_linear": True,
        "attention_dropout": 0.0, "hidden_dropout": 0.0,
    }
    if c.moe is not None:
        m = c.moe
        pattern = "1" if not m.first_dense_layers else f"([0]*{m.first_dense_layers}+[1]*{c.n_layers - m.first_dense_layers})"
        preset.update({
            "num_experts": m.num_experts, "moe_router_topk": m.top_k, "moe_ffn_hidden_size": m.ffn_dim,
            "moe_layer_freq": str(m.layer_freq) if not m.first_dense_layers else pattern,
            "moe_shared_expert_intermediate_size": m.shared_expert_ffn_dim or None,
            "moe_router_score_function": m.score_func, "moe_router_pre_softmax": m.pre_softmax,
            "moe_router_topk_scaling_factor": m.route_scale if m.route_scale != 1.0 else None,
            "moe_router_load_balancing_type": m.load_balancing, "moe_aux_loss_coeff": m.aux_loss_coeff,
            "moe_z_loss_coeff": m.z_loss_coeff or None, "moe_router_enable_expert_bias": m.expert_bias,
            "moe_router_bias_update_rate": m.bias_update_rate, "moe_expert_capacity_factor": m.capacity_factor,
            "moe_token_drop_policy": m.token_drop_policy, "moe_grouped_gemm": m.grouped_gemm,
        })
    return preset


def parse_train_args(argv: list[str]) -> tuple[TrainArgs, list[str]]:
    """(args, notes) from a command line; notes are one-liners about accepted no-op flags."""
    namespace = vars(build_parser().parse_args(argv))
    notes = []
    for name, reason in NOTED_FLAGS.items():
        if namespace.pop(name, None) not in (None, False):
            notes.append(f"{flag_of(name)} accepted: {reason}")
    values: dict[str, Any] = {}
    config_path = namespace.pop("config", None)
    file_values = {}
    if config_path is not None:
        file_values = {key.replace("-", "_"): value for key, value in load_toml(Path(config_path)).items()}
        file_values = config_passes(file_values, config_path, namespace)  # [[passes]] tables: plan_args.py
        known = {f.name for f in fields(TrainArgs)}
        unknown = sorted(set(file_values) - known)
        if unknown:
            raise ArgumentError(f"{config_path}: unknown option(s) {unknown}; keys are flag names such as 'train_iters'")
        kinds = {f.name: _base_type(f.type) for f in fields(TrainArgs)}
        try:
            file_values = check_toml_types(file_values, kinds, str(config_path))
        except OptionValueError as error:
            raise ArgumentError(str(error)) from None
    # Each source's --model applies at that source's level: a preset named on the command line
    # replaces the architecture the TOML describes (a shared run.toml with sizes must not turn
    # `--model llama3-70b` into a silent no-op), and flags still override the preset.
    for module in [*file_values.get("custom_import", []), *namespace.get("custom_import", [])]:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ArgumentError(f"--custom-import {module}: {error}. Fix: a module importable from here "
                                "(on PYTHONPATH, or a package installed in this environment)") from None
    if "model" in file_values:
        values.update(_preset(file_values["model"]))
    values.update(file_values)
    if "model" in namespace:
        preset = _preset(namespace["model"])
        replaced = sorted(key for key in preset if key in file_values and file_values[key] != preset[key])
        if replaced:
            notes.append(f"--model {namespace['model']} replaces {', '.join(replaced)} from {config_path}")
        values.update(preset)
    values.update(namespace)
    args = TrainArgs(**values)
    try:
        check_ranges(args)
    except OptionValueError as error:
        raise ArgumentError(str(error)) from None
    if args.transformer_impl == "transformer_engine" and not (args.fp8_format or args.fp8_hybrid):
        notes.append("--transformer-impl transformer_engine: dtmega's own modules run; Transformer Engine backs the "
                     "FP8 linears only (with --fp8-format)")
    return args, notes


def to_toml_dict(args: TrainArgs) -> dict[str, Any]:
    """The options as TOML-ready data (None left out)."""
    return {k: v for k, v in dataclasses.asdict(args).items() if v is not None}

