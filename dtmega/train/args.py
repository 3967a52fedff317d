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
from typing import TYPE_CHECKING, Any, ClassVar

from dtmega.data.tokenizers import TOKENIZER_TYPES
from dtmega.models.llama.config import NAMED_CONFIGS
from dtmega.passes import (
    Compile,
    ContextParallel,
    DataParallel,
    ExpertParallel,
    Float8,
    FuseKernels,
    Pass,
    PipelineSplit,
    Recompute,
    SequenceParallel,
    TensorParallel,
)
from dtmega.passes.fused_ops import FUSED_OPS
from dtmega.passes.toml_io import load_toml
from dtmega.train.arg_checks import (
    OptionValueError,
    check_ranges,
    check_toml_types,
    flag_of,
)
from dtmega.train.arg_fields import ArgumentError
from dtmega.train.arg_fields import opt as _opt
from dtmega.train.logging_args import LoggingArgs
from dtmega.train.megatron_only_args import MegatronOnlyArgs
from dtmega.train.schedule import LRSchedule, WeightDecaySchedule

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ModelArgs:
    """The model: a registered name or Megatron's size flags, and what the family's config takes."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("num_layers", "hidden_size", "ffn_hidden_size",
        "num_attention_heads", "num_query_groups", "seq_length", "max_position_embeddings",
        "make_vocab_size_divisible_by", "kv_channels", "padded_vocab_size", "rotary_seq_len_interpolation_factor")
    # counts, rates and coefficients where 0 means none but a negative value means nothing
    at_least_zero: ClassVar[tuple[str, ...]] = ("attention_dropout", "hidden_dropout")
    # strictly positive reals
    positive: ClassVar[tuple[str, ...]] = ("init_method_std", "norm_epsilon", "rotary_base", "rotary_percent")

    model: str | None = _opt(None, "a registered model: " + ", ".join(NAMED_CONFIGS) + ", or one of your own "
                                   "(dtmega.models.register_model in a --custom-import module)")
    custom_import: list[str] = _opt([], "Python modules to import first (they register models, families, passes)")
    num_layers: int | None = _opt(None, "transformer blocks")
    hidden_size: int | None = _opt(None, "model width")
    ffn_hidden_size: int | None = _opt(None, "MLP width (default: Megatron's SwiGLU rule, 8/3 x hidden, multiple of 64)")
    num_attention_heads: int | None = _opt(None, "attention heads")
    group_query_attention: bool = _opt(False, "use grouped-query attention (with --num-query-groups)")
    num_query_groups: int | None = _opt(None, "key/value heads under --group-query-attention")
    seq_length: int = _opt(1024, "tokens per sample")
    max_position_embeddings: int | None = _opt(None, "RoPE table length (default: --seq-length)")
    init_method_std: float = _opt(0.02, "std of the normal init")
    untie_embeddings_and_output_weights: bool = _opt(False, "separate input embedding and output layer")
    swiglu: bool = _opt(False, "SwiGLU MLP (dtmega's Llama always uses it)")
    normalization: str = _opt("RMSNorm", "norm layer (LayerNorm: not supported yet)", ("RMSNorm", "LayerNorm"))
    norm_epsilon: float = _opt(1e-5, "norm epsilon")
    position_embedding_type: str = _opt("rope", "position embedding (learned_absolute and none: not supported yet)",
                                        ("rope", "learned_absolute", "none"))
    rotary_base: float = _opt(10000.0, "RoPE theta")
    rotary_percent: float = _opt(1.0, "share of each head's dimensions RoPE rotates (only 1.0 is supported)")
    kv_channels: int | None = _opt(None, "head dimension (only --hidden-size / --num-attention-heads is supported)")
    qk_layernorm: bool = _opt(False, "normalize queries and keys per head (not supported yet)")
    apply_layernorm_1p: bool = _opt(False, "norm weights stored as (1 + w), zero-centred (not supported yet)")
    attention_backend: str | None = _opt(None, "attention kernel (auto: torch's scaled_dot_product_attention picks it; "
                                               "the others are not supported yet)",
                                         ("auto", "flash", "fused", "unfused", "local"))
    use_rope_scaling: bool = _opt(False, "Llama-3.1 RoPE frequency scaling")
    make_vocab_size_divisible_by: int = _opt(128, "pad the vocabulary to a multiple of this x TP size")
    padded_vocab_size: int | None = _opt(None, "the model's vocabulary size exactly (at least the tokenizer's, a "
                                               "multiple of TP), instead of the padding --make-vocab-size-divisible-by "
                                               "computes")
    rotary_seq_len_interpolation_factor: int | None = _opt(None, "RoPE position interpolation: positions divided by "
                                                                 "this (only 1 is supported)")
    attention_dropout: float = _opt(0.0, "dropout on attention probabilities (only 0 is supported)")
    hidden_dropout: float = _opt(0.0, "dropout on the residual stream (only 0 is supported)")


@dataclass(frozen=True)
class ParallelArgs:
    """How the run is split over ranks (pipelines apart): TP/SP, CP, data parallelism, EP, recompute, compile,
    --auto-plan."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("tensor_model_parallel_size", "microbatches", "context_parallel_size",
        "data_parallel_shard_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
        "recompute_num_layers")

    tensor_model_parallel_size: int = _opt(1, "TP size")
    microbatches: int | None = _opt(None, "micro-batches per step (default: global batch / micro batch / DP)")
    context_parallel_size: int = _opt(1, "CP size: every sequence split over this many ranks")
    cp_comm_type: str = _opt("p2p", "context-parallel attention: p2p (ring), all_gather, a2a (Ulysses)",
                             ("p2p", "all_gather", "a2a"))
    sequence_parallel: bool = _opt(False, "sequence parallelism (needs TP > 1)")
    tp_comm_overlap: bool = _opt(False, "overlap TP communication with the GEMMs (not supported yet)")
    use_distributed_optimizer: bool = _opt(False, "shard optimizer state over data-parallel ranks (FSDP)")
    data_parallel: str | None = _opt(None, "ddp, fsdp or hsdp (default: fsdp with --use-distributed-optimizer, else ddp)",
                                     ("ddp", "fsdp", "hsdp"))
    use_torch_fsdp2: bool = _opt(False, "Megatron's switch to PyTorch FSDP2: = --data-parallel fsdp")
    grad_reduce_in_bf16: bool = _opt(False, "reduce gradients across data-parallel ranks in bf16 (default fp32)")
    data_parallel_shard_size: int | None = _opt(None, "ranks each HSDP replica shards over (with --data-parallel hsdp)")
    expert_model_parallel_size: int = _opt(1, "EP size: experts split over this many of the data-parallel ranks")
    expert_tensor_parallel_size: int | None = _opt(None, "ETP size: each expert's hidden dim split (only = TP; default TP)")
    cpu_optimizer: bool = _opt(False, "keep fp32 weights, gradients and Adam state on the host and step there "
                                      "(FSDP2's CPU offload; implies --data-parallel fsdp unless hsdp is given)")
    cpu_optimizer_type: str = _opt("ADAM", "the host optimizer (AdamW, as on the device)", ("ADAM", "adam"))
    auto_plan: bool = _opt(False, "choose TP, PP, CP, data parallelism, micro-batch, recompute and --cpu-optimizer "
                                  "with the cost model (dtmega plan) for this world size")
    hardware: str | None = _opt(None, "with --auto-plan: h100, h200, a100, b200 or a `dtmega calibrate` file "
                                      "(default: the GPU found; required on a CPU)")
    recompute_granularity: str | None = _opt(None, "activation recompute", ("full", "selective"))
    recompute_activations: bool = _opt(False, "Megatron's short form of --recompute-granularity selective")
    recompute_method: str | None = _opt(None, "which blocks under full recompute", ("uniform", "block"))
    recompute_num_layers: int | None = _opt(None, "blocks per recompute unit (uniform) or recomputed blocks (block)")
    compile: str | None = _opt(None, "torch.compile backend for the blocks (inductor, aot_eager)")

    def split_passes(self, shape: Any, n_layers: int) -> list[Pass]:
        """The passes that split the model within a data-parallel replica (TP, SP, CP, EP) and
        recompute, in plan order; `shape` is the run's RunShape."""
        passes: list[Pass] = []
        if shape.tp > 1:
            passes.append(TensorParallel())
        if self.sequence_parallel and shape.tp > 1:  # at TP 1 Megatron turns it off with a warning (plan_notes)
            passes.append(SequenceParallel())
        if shape.cp > 1:
            method = {"p2p": "ring", "all_gather": "all_gather", "a2a": "a2a"}[self.cp_comm_type]
            passes.append(ContextParallel(method=method))
        etp = self.expert_tensor_parallel_size
        if etp is not None and etp != shape.tp:
            raise ArgumentError(
                f"--expert-tensor-parallel-size {etp}: the experts' hidden dim is split over the tensor-parallel "
                f"ranks, so ETP equals TP ({shape.tp}) here (ETP < TP, Megatron's parallel folding, is not supported "
                "yet). Fix: leave it unset"
            )
        if shape.ep > 1:
            passes.append(ExpertParallel(dispatcher=self.moe_token_dispatcher_type))  # type: ignore[attr-defined]
        return passes + self._recompute_passes(n_layers)

    def _recompute_passes(self, n_layers: int) -> list[Pass]:
        if self.recompute_activations and self.recompute_granularity == "full":
            raise ArgumentError("--recompute-activations (selective) and --recompute-granularity full disagree. Fix: "
                                "keep one")
        if self.recompute_granularity == "selective" or self.recompute_activations:
            return [Recompute("selective")]
        if self.recompute_granularity == "full":
            if self.recompute_method == "block":
                return [Recompute("full", first=self.recompute_num_layers or n_layers)]
            return [Recompute("full")]  # uniform, one block per unit (groups of several blocks were refused)
        if self.recompute_method or self.recompute_num_layers:
            raise ArgumentError("--recompute-method/--recompute-num-layers need --recompute-granularity full")
        return []

    def data_parallel_mode(self) -> str:
        """ddp unless the optimizer is to be sharded (--use-distributed-optimizer) or a mode is given
        (--data-parallel, or Megatron-FSDP's sharding strategy)."""
        megatron_fsdp = self.megatron_fsdp_mode()  # type: ignore[attr-defined]
        if self.data_parallel:
            if self.use_torch_fsdp2 and self.data_parallel == "ddp":
                raise ArgumentError("--use-torch-fsdp2 and --data-parallel ddp disagree. Fix: keep one")
            if megatron_fsdp and megatron_fsdp != self.data_parallel:
                raise ArgumentError(f"--use-megatron-fsdp (--data-parallel-sharding-strategy) asks for {megatron_fsdp} "
                                    f"and --data-parallel for {self.data_parallel}. Fix: keep one")
            return self.data_parallel
        if megatron_fsdp:
            return megatron_fsdp
        return "fsdp" if self.use_distributed_optimizer or self.cpu_optimizer or self.use_torch_fsdp2 else "ddp"

    def data_parallel_passes(self, param_dtype: str) -> list[Pass]:
        """DataParallel in the chosen mode (gradients reduced in fp32), then Compile if asked."""
        mode = self.data_parallel_mode()
        if self.cpu_optimizer and mode == "ddp":
            raise ArgumentError("--cpu-optimizer keeps each rank's shard of the weights, gradients and Adam state on "
                                "the host, which needs sharded data parallelism. Fix: --data-parallel fsdp (or hsdp), "
                                "or drop --data-parallel ddp")
        in_bf16 = self.grad_reduce_in_bf16 or self.megatron_fsdp_grad_comm_dtype == "bf16"  # type: ignore[attr-defined]
        reduce_dtype = "bfloat16" if in_bf16 else "float32"
        passes: list[Pass] = [DataParallel(mode, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                           offload=self.cpu_optimizer)]
        if self.compile:
            passes.append(Compile(backend=self.compile))
        return passes


@dataclass(frozen=True)
class PipelineArgs:
    """Pipeline parallelism: the size, and how blocks split into stages and which schedule runs."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage")
    # counts, rates and coefficients where 0 means none but a negative value means nothing
    at_least_zero: ClassVar[tuple[str, ...]] = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")

    pipeline_model_parallel_size: int = _opt(1, "PP size")
    pipeline_schedule: str | None = _opt(None, "pipeline schedule (default: 1f1b, or interleaved_1f1b with virtual stages)",
                                         ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                                          "zbv", "dualpipev"))
    num_layers_per_virtual_pipeline_stage: int | None = _opt(None, "blocks per virtual stage (interleaved schedules)")
    decoder_first_pipeline_num_layers: int | None = _opt(None, "blocks on the first pipeline stage (uneven split)")
    decoder_last_pipeline_num_layers: int | None = _opt(None, "blocks on the last pipeline stage (uneven split)")
    account_for_embedding_in_pipeline_split: bool = _opt(False, "the embedding takes one block's slot in the split")
    account_for_loss_in_pipeline_split: bool = _opt(False, "the output layer and loss take one block's slot")
    pipeline_model_parallel_layout: str | None = _opt(None, "explicit split, e.g. 'Et*3|t*4|t*4|t*3L'")

    def pipeline_passes(self, shape: Any, n_layers: int) -> list[Pass]:
        """PipelineSplit from Megatron's pipeline flags (micro-batches are the accumulation steps);
        none at PP 1, where any other pipeline flag is refused."""
        if shape.pp == 1:
            given = [f"--{f.name.replace('_', '-')}" for f in fields(PipelineArgs)
                     if f.name != "pipeline_model_parallel_size" and getattr(self, f.name)]
            if given:
                raise ArgumentError(f"pipeline options ({', '.join(given)}) need --pipeline-model-parallel-size > 1")
            return []
        virtual = 1
        if self.num_layers_per_virtual_pipeline_stage:
            per = self.num_layers_per_virtual_pipeline_stage
            if n_layers % (per * shape.pp):
                raise ArgumentError(
                    f"--num-layers {n_layers} is not divisible by --num-layers-per-virtual-pipeline-stage {per} x "
                    f"--pipeline-model-parallel-size {shape.pp}"
                )
            virtual = n_layers // (per * shape.pp)
        schedule = self.pipeline_schedule or ("interleaved_1f1b" if virtual > 1 else "1f1b")
        return [PipelineSplit(
            schedule=schedule, microbatches=shape.accumulation, virtual_stages=virtual,
            first_stage_layers=self.decoder_first_pipeline_num_layers,
            last_stage_layers=self.decoder_last_pipeline_num_layers,
            count_embedding=self.account_for_embedding_in_pipeline_split,
            count_loss=self.account_for_loss_in_pipeline_split, layout=self.pipeline_model_parallel_layout,
        )]


@dataclass(frozen=True)
class FusionArgs:
    """Fused kernels (FuseKernels: Triton on GPUs, the PyTorch references elsewhere)."""

    cross_entropy_loss_fusion: bool = _opt(False, "output layer + cross entropy in one chunked kernel (logits never "
                                                  "materialized; vocab-parallel under TP)")
    cross_entropy_fusion_impl: str = _opt("native", "which fused cross entropy: native (dtmega's kernel); te "
                                                    "(Transformer Engine's) is refused where it is not installed",
                                          ("native", "te"))
    no_rope_fusion: bool = _opt(False, "apply RoPE to q and k with plain PyTorch ops instead of one fused kernel")
    no_bias_swiglu_fusion: bool = _opt(False, "SwiGLU with plain PyTorch ops instead of the fused kernel")
    no_rms_norm_fusion: bool = _opt(False, "RMSNorm (and the residual add before it) without the fused kernels")

    def fusion_passes(self) -> list[Pass]:
        """FuseKernels with each registered op's switch from its flag: None lets FuseKernels decide
        (fused, except inside blocks compiled on a GPU, where inductor's fusion measured faster),
        False is off; no pass when every op is off."""
        switches = {op.switch: bool(getattr(self, op.flag)) if op.flag_turns_on
                    else (False if getattr(self, op.flag) else None)
                    for op in FUSED_OPS.values() if op.flag}
        return [FuseKernels(**switches)] if any(value is not False for value in switches.values()) else []


@dataclass(frozen=True)
class FP8Args:
    """FP8 training (the Float8 pass; docs/fp8.md)."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("fp8_amax_history_len",)
    # counts, rates and coefficients where 0 means none but a negative value means nothing
    at_least_zero: ClassVar[tuple[str, ...]] = ("fp8_min_features", "fp8_margin", "num_layers_at_start_in_bf16",
        "num_layers_at_end_in_bf16")

    fp8_format: str | None = _opt(None, "train the blocks' linears in FP8: e4m3 everywhere, or hybrid (e4m3 forward, "
                                        "e5m2 gradients)", ("e4m3", "hybrid"))
    fp8_hybrid: bool = _opt(False, "= --fp8-format hybrid")
    fp8_recipe: str = _opt("delayed", "FP8 scaling", ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"))
    fp8_amax_history_len: int = _opt(1, "delayed scaling: steps of amax history")
    fp8_margin: int = _opt(0, "scale-factor margin, as a power of 2 (only 0 is supported)")
    fp8_amax_compute_algo: str = _opt("most_recent", "delayed scaling: scale from the history's max or its newest",
                                      ("max", "most_recent"))
    fp8_param_gather: bool = _opt(False, "FSDP all-gathers the weights in FP8 (delayed or tensorwise scaling; needs "
                                         "--use-distributed-optimizer)")
    fp8_min_features: int = _opt(1024, "linears with fewer input or output features stay bf16 (FP8 loses there)")
    first_last_layers_bf16: bool = _opt(False, "keep the first and last blocks in bf16 under FP8")
    num_layers_at_start_in_bf16: int = _opt(1, "with --first-last-layers-bf16: blocks at the start kept bf16")
    num_layers_at_end_in_bf16: int = _opt(1, "with --first-last-layers-bf16: blocks at the end kept bf16")
    transformer_impl: str = _opt("local", "local: dtmega's modules (FP8 by its own kernels); transformer_engine: "
                                          "FP8 linears by Transformer Engine", ("local", "transformer_engine"))

    def fp8_passes(self) -> list[Pass]:
        """The Float8 pass Megatron's --fp8-* flags describe (none without --fp8-format/--fp8-hybrid).
        The backend: Transformer Engine with --transformer-impl transformer_engine, else dtmega's own
        FP8 linear (which also gathers FSDP shards in FP8 with --fp8-param-gather); torchao's
        Float8Linear is the Python API's `Float8(backend="torchao")`."""
        fmt = "hybrid" if self.fp8_hybrid else self.fp8_format
        if fmt is None:
            given = [f"--{n.replace('_', '-')}" for n in ("fp8_param_gather", "first_last_layers_bf16")
                     if getattr(self, n)]
            if given:
                raise ArgumentError(f"{', '.join(given)} need(s) FP8: add --fp8-format hybrid (or --fp8-hybrid)")
            return []
        if self.fp8_hybrid and self.fp8_format not in (None, "hybrid"):
            raise ArgumentError(f"--fp8-hybrid and --fp8-format {self.fp8_format} disagree; give one of them")
        keep = self.first_last_layers_bf16
        return [Float8(recipe=self.fp8_recipe, format=fmt,
                       backend="transformer_engine" if self.transformer_impl == "transformer_engine" else "dtmega",
                       amax_history_len=self.fp8_amax_history_len, amax_compute_algo=self.fp8_amax_compute_algo,
                       param_gather=self.fp8_param_gather, min_features=self.fp8_min_features,
                       first_blocks_bf16=self.num_layers_at_start_in_bf16 if keep else 0,
                       last_blocks_bf16=self.num_layers_at_end_in_bf16 if keep else 0)]


@dataclass(frozen=True)
class MoEArgs:
    """Mixture of experts: the experts, their router and its balancing, dispatch."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size")
    # counts, rates and coefficients where 0 means none but a negative value means nothing
    at_least_zero: ClassVar[tuple[str, ...]] = ("moe_aux_loss_coeff", "moe_z_loss_coeff",
        "moe_router_bias_update_rate")
    # strictly positive reals
    positive: ClassVar[tuple[str, ...]] = ("moe_expert_capacity_factor", "moe_router_topk_scaling_factor")

    num_experts: int | None = _opt(None, "experts per MoE layer (unset: every block dense)")
    moe_router_topk: int = _opt(2, "experts each token is routed to")
    moe_ffn_hidden_size: int | None = _opt(None, "hidden size of one expert (default: --ffn-hidden-size)")
    moe_layer_freq: str = _opt("1", "MoE on every k-th block (an int), or a pattern '([0]*K+[1]*M)': K dense first")
    moe_shared_expert_intermediate_size: int | None = _opt(None, "hidden size of the shared experts (unset: none)")
    moe_router_score_function: str = _opt("softmax", "router scores", ("softmax", "sigmoid"))
    moe_router_pre_softmax: bool = _opt(False, "softmax over all experts before top-k (default: over the k chosen)")
    moe_router_topk_scaling_factor: float | None = _opt(None, "multiply the routing weights by this")
    moe_router_load_balancing_type: str = _opt("aux_loss", "balancing loss: over the micro-batch, per sequence, none",
                                               ("aux_loss", "seq_aux_loss", "none"))
    moe_aux_loss_coeff: float = _opt(0.0, "weight of the load-balancing loss")
    moe_z_loss_coeff: float | None = _opt(None, "weight of the router z-loss")
    moe_router_enable_expert_bias: bool = _opt(False, "auxiliary-loss-free balancing: a per-expert routing bias")
    moe_router_bias_update_rate: float = _opt(1e-3, "step of the expert-bias update")
    moe_expert_capacity_factor: float | None = _opt(None, "tokens per expert per sequence, x even share (unset: dropless)")
    moe_token_drop_policy: str = _opt("probs", "which tokens an over-capacity expert keeps", ("probs", "position"))
    moe_token_dispatcher_type: str = _opt("allgather", "how tokens reach their experts' ranks (flex: not supported "
                                                       "yet)", ("alltoall", "allgather", "flex"))
    moe_grouped_gemm: bool = _opt(False, "run the local experts as one grouped GEMM (else a loop over experts)")


@dataclass(frozen=True)
class OptimizerArgs:
    """Batch sizes, schedule, AdamW, mixed precision and loss scaling, divergence checks."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("micro_batch_size", "global_batch_size", "train_iters",
        "lr_decay_iters", "lr_wsd_decay_iters", "loss_scale_window", "max_skipped_steps", "train_samples",
        "lr_decay_samples", "lr_wsd_decay_samples")
    # counts, rates and coefficients where 0 means none but a negative value means nothing
    at_least_zero: ClassVar[tuple[str, ...]] = ("lr", "min_lr", "lr_warmup_iters", "weight_decay", "clip_grad",
        "hysteresis", "lr_warmup_samples", "lr_warmup_init", "start_weight_decay", "end_weight_decay")
    # strictly positive reals
    positive: ClassVar[tuple[str, ...]] = ("adam_eps", "initial_loss_scale", "min_loss_scale", "loss_scale")
    # coefficients in [0, 1): a beta of 1 never forgets, above 1 it grows without bound
    unit_interval: ClassVar[tuple[str, ...]] = ("adam_beta1", "adam_beta2", "lr_warmup_fraction", "sgd_momentum")

    micro_batch_size: int | None = _opt(None, "sequences per rank per micro-batch (default 1, or from --microbatches)")
    global_batch_size: int | None = _opt(None, "sequences per step (default: micro batch x data-parallel size)")
    train_iters: int | None = _opt(None, "optimizer steps")
    train_samples: int | None = _opt(None, "samples to train on, instead of --train-iters (steps = samples / global "
                                           "batch); the schedule's lengths are then in samples too")
    lr: float | None = _opt(None, "peak learning rate")
    min_lr: float = _opt(0.0, "final learning rate")
    lr_decay_style: str = _opt("linear", "decay after warmup", ("constant", "linear", "cosine", "WSD"))
    lr_warmup_iters: int = _opt(0, "linear warmup steps")
    lr_decay_iters: int | None = _opt(None, "steps until min_lr (default: --train-iters)")
    lr_wsd_decay_iters: int | None = _opt(None, "WSD: length of the final decay (default: 10 %% of the decay steps)")
    lr_wsd_decay_style: str = _opt("linear", "WSD decay shape", ("linear", "cosine", "exponential", "minus_sqrt"))
    lr_decay_samples: int | None = _opt(None, "with --train-samples: samples until min_lr (default: --train-samples)")
    lr_warmup_samples: int = _opt(0, "with --train-samples: linear warmup samples")
    lr_wsd_decay_samples: int | None = _opt(None, "with --train-samples: WSD's final decay in samples")
    lr_warmup_fraction: float | None = _opt(None, "warmup as a fraction of the decay length (instead of "
                                                  "--lr-warmup-iters/--lr-warmup-samples)")
    lr_warmup_init: float = _opt(0.0, "learning rate the warmup starts from")
    decoupled_lr: float | None = _opt(None, "a separate learning rate for the embedding and output layer (not "
                                            "supported yet)")
    decoupled_min_lr: float | None = _opt(None, "with --decoupled-lr: its final learning rate (not supported yet)")
    weight_decay: float = _opt(0.01, "weight decay (never on norms and biases)")
    start_weight_decay: float | None = _opt(None, "weight decay at the start, with --weight-decay-incr-style linear "
                                                  "or cosine")
    end_weight_decay: float | None = _opt(None, "weight decay at the end of the run, with --weight-decay-incr-style "
                                                "linear or cosine")
    weight_decay_incr_style: str = _opt("constant", "weight decay over the run: constant (--weight-decay), or from "
                                                    "--start-weight-decay to --end-weight-decay",
                                        ("constant", "linear", "cosine"))
    clip_grad: float = _opt(1.0, "clip the global gradient norm to this (0 = off)")
    no_check_for_nan_in_loss_and_grad: bool = _opt(False, "never stop a run for non-finite losses or gradient "
                                                          "norms (such steps are still skipped)")
    max_skipped_steps: int = _opt(10, "non-finite steps in a row that stop the run as diverged (exit 2)")
    check_for_spiky_loss: bool = _opt(False, "a loss above 10x the recent maximum re-runs its step once on the same "
                                             "batch: reproduced = from the data or model, not = a transient fault")
    optimizer: str = _opt("adam", "adam (AdamW, decoupled weight decay, as Megatron's adam) or sgd (momentum "
                                  "--sgd-momentum, L2 weight decay)", ("adam", "sgd"))
    sgd_momentum: float = _opt(0.9, "momentum of --optimizer sgd")
    adam_beta1: float = _opt(0.9, "AdamW beta1")
    adam_beta2: float = _opt(0.999, "AdamW beta2")
    adam_eps: float = _opt(1e-8, "AdamW epsilon")
    bf16: bool = _opt(False, "bf16 compute, fp32 master weights and gradient reduction")
    fp16: bool = _opt(False, "fp16 compute with dynamic loss scaling")
    loss_scale: float | None = _opt(None, "static loss scale for --fp16 (default: dynamic)")
    initial_loss_scale: float = _opt(2.0**32, "first dynamic loss scale")
    min_loss_scale: float = _opt(1.0, "smallest dynamic loss scale")
    loss_scale_window: int = _opt(1000, "steps without overflow before the scale doubles")
    hysteresis: int = _opt(2, "overflows tolerated before the scale halves")

    def check_schedule(self) -> None:
        """Refuses the run length and schedule flags that contradict each other (Megatron's rules),
        naming the flag to drop; reads the arguments only, so every rank refuses alike."""
        def given(names: tuple[str, ...]) -> list[str]:
            return [f"--{n.replace('_', '-')}" for n in names if getattr(self, n)]

        if self.train_iters is not None and self.train_samples is not None:
            raise ArgumentError("--train-iters and --train-samples both give the run's length. Fix: keep one")
        by_samples = self.train_samples is not None
        wrong = given(("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters") if by_samples else
                      ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples"))
        if wrong:
            unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
            raise ArgumentError(f"{', '.join(wrong)} count {other}, but the run's length is given in {unit} "
                                f"(--train-{unit}). Fix: use the --lr-*-{unit} flags with --train-{unit}")
        if self.lr_warmup_fraction is not None and (self.lr_warmup_iters or self.lr_warmup_samples):
            raise ArgumentError("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples both give the warmup. "
                                "Fix: keep one")
        if self.lr is not None and self.lr_warmup_init > self.lr:
            raise ArgumentError(f"--lr-warmup-init {self.lr_warmup_init} is above --lr {self.lr}: the warmup would "
                                "lower the rate. Fix: a --lr-warmup-init of at most --lr")
        ends = (self.start_weight_decay, self.end_weight_decay)
        if self.weight_decay_incr_style == "constant":
            if None not in ends and ends[0] != ends[1]:
                raise ArgumentError(f"--start-weight-decay {ends[0]} and --end-weight-decay {ends[1]} differ, but "
                                    "--weight-decay-incr-style is constant. Fix: --weight-decay-incr-style linear "
                                    "(or cosine)")
        elif None in ends:
            raise ArgumentError(f"--weight-decay-incr-style {self.weight_decay_incr_style} needs --start-weight-decay "
                                "and --end-weight-decay")

    def total_steps(self, global_batch: int) -> int:
        """Optimizer steps of the run: --train-iters, or --train-samples over the global batch."""
        if self.train_samples is None:
            return int(self.train_iters or 0)
        if self.train_samples < global_batch:
            raise ArgumentError(f"--train-samples {self.train_samples} is less than one global batch ({global_batch} "
                                "sequences): the run would take no step. Fix: at least one global batch of samples")
        return self.train_samples // global_batch

    def schedules(self, global_batch: int) -> tuple[LRSchedule, WeightDecaySchedule]:
        """The learning-rate and weight-decay schedules in optimizer steps (sample counts divided by
        the global batch, so a sample-based schedule equals the iteration-based one it spells)."""
        if self.train_samples is not None:
            unit = float(global_batch)
            decay = (self.lr_decay_samples or self.train_samples) / unit
            warmup = self.lr_warmup_samples / unit
            wsd = self.lr_wsd_decay_samples / unit if self.lr_wsd_decay_samples else None
            length = self.train_samples / unit
        else:
            decay = float(self.lr_decay_iters or self.train_iters or 0)
            warmup, wsd, length = float(self.lr_warmup_iters), self.lr_wsd_decay_iters, float(self.train_iters or 0)
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        if self.lr_decay_style != "constant" and decay <= warmup:
            raise ArgumentError(f"the learning-rate decay ({decay:g} steps) must be longer than its warmup "
                                f"({warmup:g} steps). Fix: a longer --lr-decay-iters/--lr-decay-samples, or a shorter "
                                "warmup")
        lr = LRSchedule(float(self.lr or 0.0), self.min_lr, warmup, decay, self.lr_decay_style, wsd,
                        self.lr_wsd_decay_style, init_lr=self.lr_warmup_init)
        if self.weight_decay_incr_style == "constant":
            value = self.start_weight_decay if self.start_weight_decay is not None else self.weight_decay
            return lr, WeightDecaySchedule(value, value, length)
        return lr, WeightDecaySchedule(self.start_weight_decay, self.end_weight_decay, length,  # type: ignore[arg-type]
                                       self.weight_decay_incr_style)

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The optimizer --optimizer names, over `model`'s (sharded) parameters, with Megatron's
        groups: no weight decay on norms and biases."""
        from dtmega.train.optim import adamw, sgd

        if self.optimizer == "sgd":
            return sgd(model, lr=self.lr or 0.0, weight_decay=self.weight_decay, momentum=self.sgd_momentum)
        return adamw(model, lr=self.lr or 0.0, weight_decay=self.weight_decay, betas=(self.adam_beta1, self.adam_beta2),
                     eps=self.adam_eps)

    @property
    def compute_dtype(self) -> str:
        """The parameters' compute dtype (--bf16, --fp16, else float32); master weights and
        gradient reduction stay fp32."""
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"


@dataclass(frozen=True)
class DataArgs:
    """The data: dataset prefixes and split, tokenizer, document handling, order."""
    # sizes and counts that must be >= 1 when given
    at_least_one: ClassVar[tuple[str, ...]] = ("vocab_size",)

    data_path: list[str] = _opt([], "dataset prefix(es), optionally weighted: 0.3 a 0.7 b")
    train_data_path: list[str] | None = _opt(None, "the training split's own dataset prefix(es), weighted as "
                                                   "--data-path (instead of --data-path and --split)")
    valid_data_path: list[str] | None = _opt(None, "the validation split's own dataset prefix(es) (none: no "
                                                   "validation)")
    test_data_path: list[str] | None = _opt(None, "the test split's own dataset prefix(es): evaluated once at the "
                                                  "end of the run, --eval-iters batches")
    data_cache_path: str | None = _opt(None, "directory for the sample indices built from the data (default: beside "
                                             "each dataset; for data on a read-only file system)")
    no_mmap_bin_files: bool = _opt(False, "read .bin files without memory mapping (not supported yet)")
    mock_data: bool = _opt(False, "synthetic samples of the run's shape instead of --data-path (random ids of the "
                                  "tokenizer's vocabulary: for trying a launch line before the data exists)")
    split: str = _opt("969,30,1", "train,valid,test document proportions")
    tokenizer_type: str | None = _opt(None, "tokenizer used by preprocessing", TOKENIZER_TYPES)
    tokenizer_model: str | None = _opt(None, "tokenizer.json or a Hugging Face directory (HuggingFaceTokenizer), a "
                                             "SentencePiece tokenizer.model (Llama2Tokenizer, GPTSentencePieceTokenizer)")
    vocab_size: int | None = _opt(None, "NullTokenizer (pre-tokenized data): the token ids are 0..N-1, N is "
                                        "end-of-document")
    vocab_file: str | None = _opt(None, "vocab.json (GPT2BPETokenizer)")
    merge_file: str | None = _opt(None, "merges.txt (GPT2BPETokenizer)")
    eod_token: str | None = _opt(None, "end-of-document token (default: found in the vocabulary)")
    eod_mask_loss: bool = _opt(False, "no loss on positions whose input is end-of-document")
    reset_position_ids: bool = _opt(False, "restart position ids after each end-of-document")
    reset_attention_mask: bool = _opt(False, "block attention across documents (not supported yet)")
    dataloader_type: str = _opt("single", "single: the dataset's own (shuffled) order; cyclic: also a fresh "
                                          "shuffle of the samples every pass (resumable)", ("single", "cyclic"))

    @property
    def per_split_paths(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None:
        """(train, valid, test) prefixes of --train/--valid/--test-data-path, or None when the
        run reads --data-path with --split."""
        given = (self.train_data_path, self.valid_data_path, self.test_data_path)
        if not any(given):
            return None
        return tuple(tuple(paths or ()) for paths in given)  # type: ignore[return-value]

    @property
    def data_prefixes(self) -> list[str]:
        """Every dataset prefix the run reads, whichever flags name them (weights left out)."""
        from dtmega.data.blend import parse_data_path

        lists = [self.data_path] if self.data_path else [paths for paths in self.per_split_paths or () if paths]
        return [prefix for items in lists for _, prefix in parse_data_path(list(items))]

    def check_data_source(self) -> list[str]:
        """Refuses data flags that contradict each other (Megatron's rules), naming the flag to
        drop; returns notes for flags that then have no effect."""
        per_split = self.per_split_paths
        sources = [flag for flag, given in (("--data-path", bool(self.data_path)), ("--mock-data", self.mock_data),
                                            ("--train/valid/test-data-path", per_split is not None)) if given]
        if len(sources) > 1:
            raise ArgumentError(f"{' and '.join(sources)} both say where the samples come from. Fix: keep one")
        if not sources:
            raise ArgumentError("dtmega train needs data: --data-path (with --split), --train-data-path (and "
                                "--valid-data-path), or --mock-data")
        if per_split is None:
            return []
        if not per_split[0]:
            raise ArgumentError("--valid-data-path/--test-data-path without --train-data-path: nothing to train on. "
                                "Fix: add --train-data-path PREFIX")
        notes = []
        if self.split != "969,30,1":
            notes.append(f"--split {self.split} is not read: each split has its own --*-data-path")
        if not per_split[1]:
            notes.append("no --valid-data-path: this run has no validation (add one to validate)")
        return notes

    @property
    def split_weights(self) -> tuple[float, float, float]:
        """--split as three floats, read as Megatron reads it: the numbers in the text, whatever
        separates them ("969,30,1", "99/1/0", or "'99,1,0'" with the quotes a launch script left
        in), a missing part 0."""
        numbers = re.findall(r"\d+(?:\.\d*)?|\.\d+", self.split)
        leftover = re.sub(r"\d+(?:\.\d*)?|\.\d+|[\s,/'\"]", "", self.split)
        if not numbers or len(numbers) > 3 or leftover:
            raise ArgumentError(f"--split {self.split!r} must be up to three numbers such as 969,30,1 (train, "
                                "validation and test proportions)")
        parts = [float(x) for x in numbers] + [0.0] * (3 - len(numbers))
        if sum(parts) <= 0:
            raise ArgumentError(f"--split {self.split!r} gives no document to any part. Fix: e.g. 969,30,1")
        return tuple(parts)  # type: ignore[return-value]


@dataclass(frozen=True)
class CheckpointArgs:
    """Checkpoints, evaluation, logging and the collective timeout."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("save_interval", "eval_interval", "log_interval",
        "straggler_minmax_count", "exit_interval")
    # counts, rates and coefficients where 0 means none but a negative value means nothing
    at_least_zero: ClassVar[tuple[str, ...]] = ("eval_iters", "seed", "manual_gc_interval")
    # strictly positive reals
    positive: ClassVar[tuple[str, ...]] = ("distributed_timeout_minutes", "exit_duration_in_mins")

    save: str | None = _opt(None, "checkpoint directory to write")
    load: str | None = _opt(None, "checkpoint directory (or iter_* directory) to resume from")
    load_hf: str | None = _opt(None, "Hugging Face model directory to start from: its config, tokenizer and "
                               "weights, with a fresh optimizer and iteration count (Megatron's --finetune); a "
                               "checkpoint in --load takes precedence, so a restarted run resumes")
    save_hf: str | None = _opt(None, "also write the final checkpoint as a Hugging Face model directory (needs --save)")
    finetune: bool = _opt(False, "start from --load's weights only: iteration 0, the data from its start, a fresh "
                                 "optimizer and random state (Megatron's --finetune)")
    no_load_optim: bool = _opt(False, "resume --load's weights, step and data position with a fresh optimizer")
    no_load_rng: bool = _opt(False, "resume without restoring the saved random-number generator states")
    no_save_optim: bool = _opt(False, "save checkpoints without the optimizer state (smaller; resuming them needs "
                                      "--no-load-optim or --finetune)")
    overwrite_checkpoints: bool = _opt(False, "write into a --save that holds checkpoints this run does not resume "
                                              "(another run's, or ones further along than --load): start over there "
                                              "on purpose; without it such a --save is refused")
    save_interval: int | None = _opt(None, "steps between checkpoints (and one at the end)")
    async_save: bool = _opt(False, "write the --save-interval checkpoints in the background (DCP's async_save: the "
                                   "shards are copied to host memory, then written while training goes on; the "
                                   "checkpoint is published at the first step every rank has written it). The final "
                                   "and stopping saves wait")
    exit_interval: int | None = _opt(None, "stop (after saving, with --save) at the first step that is a multiple of "
                                           "this")
    exit_signal_handler: bool = _opt(False, "on SIGTERM, finish the step, save (with --save) and exit with status 0 "
                                            "(a preemption's clean stop; without it SIGTERM stops at once, status 143)")
    exit_duration_in_mins: float | None = _opt(None, "stop (after saving, with --save) at the first step after this "
                                                     "many minutes since the start (all ranks agree on the step)")
    eval_interval: int = _opt(1000, "steps between validation runs")
    eval_iters: int = _opt(100, "validation batches per run")
    log_interval: int = _opt(100, "steps between metric logs")
    log_straggler: bool = _opt(False, "at every log: each rank's step time and batch-fetching time, the fastest "
                                      "and slowest ranks named (one small all-gather)")
    straggler_minmax_count: int = _opt(1, "with --log-straggler: how many fastest and slowest ranks to name")
    distributed_timeout_minutes: float = _opt(10.0, "how long a rank waits for the others at start-up and in any "
                                                    "collective before the run stops naming who is missing")
    ckpt_format: str = _opt("torch_dist", "checkpoint format: torch_dist (sharded torch.distributed.checkpoint "
                                          "directories, the one format dtmega writes; torch_dcp and fsdp_dtensor "
                                          "name the same here; torch, Megatron's legacy format, is not supported)",
                            ("torch_dist", "torch_dcp", "fsdp_dtensor", "torch"))
    manual_gc: bool = _opt(False, "turn Python's automatic garbage collector off for the run and collect at "
                                  "--manual-gc-interval steps and around validations (no collector pauses at "
                                  "random steps, which stall every rank of a large job)")
    manual_gc_interval: int = _opt(0, "with --manual-gc: steps between collections (0: only around validations and "
                                      "at the end)")
    no_manual_gc_eval: bool = _opt(False, "with --manual-gc: no collection around validations")
    empty_unused_memory_level: int = _opt(0, "release the CUDA caching allocator's unused blocks: 1 after every "
                                             "step, 2 also after every validation (0: never; no effect on a CPU)",
                                          (0, 1, 2))
    profile: bool = _opt(False, "profile steps --profile-step-start to --profile-step-end (not supported yet)")
    profile_step_start: int = _opt(10, "with --profile: the first profiled step")
    profile_step_end: int = _opt(12, "with --profile: the step after the last profiled one")
    seed: int = _opt(1234, "random seed (init and data order)")


@dataclass(frozen=True)
class LaunchArgs:
    """Checking a launch before it runs."""

    dry_run: int | None = _opt(None, "check the run for N ranks (default: this launch's) on no device: arguments, "
                                     "files, plan and layout; print it and exit")

@dataclass(frozen=True)
class TrainArgs(LaunchArgs, MegatronOnlyArgs, LoggingArgs, CheckpointArgs, DataArgs, OptimizerArgs, MoEArgs,
                FP8Args, FusionArgs, PipelineArgs,
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
    "use_flash_attn": "attention uses torch's scaled_dot_product_attention, which picks flash kernels itself",
    "disable_bias_linear": "dtmega's Llama has no biases",
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
    "no_bias_dropout_fusion": "dtmega's Llama has neither biases nor dropout, so there is nothing to fuse",
    "use_rotary_position_embeddings": "RoPE is the position embedding here (--position-embedding-type rope, the "
                                      "default)",
    "use_dist_ckpt": "checkpoints are always sharded torch.distributed.checkpoint directories (Megatron's torch_dist "
                     "is DCP too; `dtmega convert` reads Megatron's)",
    "calculate_per_token_loss": "the loss is always the token-weighted mean over the whole global batch (every "
                                "micro-batch and data-parallel rank), which is what this flag asks of Megatron",
    "no_create_attention_mask_in_dataloader": "the data loader never builds an attention mask: attention is causal "
                                              "inside the kernels",
    "log_throughput": "every log line (and TensorBoard) carries tokens_per_s and tflops_per_device",
    "log_validation_ppl_to_tensorboard": "validation perplexity is always written to TensorBoard (valid/val_ppl)",
    "log_memory_to_tensorboard": "memory_gib is written to TensorBoard at every log step",
    "no_position_embedding": "Megatron's deprecated switch for the learned absolute position embedding, which "
                             "dtmega's RoPE models do not have",
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
}
_NOTED_WITH_VALUE = {"distributed_backend", "num_workers", "fp8_interval", "rerun_mode"}

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
        if f.name == "dry_run":
            parser.add_argument(flag_of(f.name), type=int, nargs="?", const=0, metavar="WORLD", help=help_text)
        elif kind is bool:
            parser.add_argument(flag_of(f.name), action="store_true", help=help_text)
        elif kind is list:
            parser.add_argument(flag_of(f.name), nargs="+", help=help_text)
        else:
            parser.add_argument(flag_of(f.name), type=kind, choices=f.metadata.get("choices"), help=help_text)
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

