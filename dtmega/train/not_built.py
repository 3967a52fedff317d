"""Megatron flags whose feature dtmega does not have yet: refused before any work, each with why
and the command-line fix. The one list `docs/training.md` ("Not built yet") shows, row for row
(tests/unit/test_docs_refusals.py holds the two equal and runs every example)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from dtmega.train.arg_fields import ArgumentError

if TYPE_CHECKING:  # the parser (args.py) reads the rows, so this module does not import it
    from dtmega.train.args import TrainArgs


@dataclass(frozen=True)
class NotBuilt:
    """A feature a flag asks for that is refused: how the docs name it, a command line that asks
    for it (`example` added to a working line, `without` taken out of it), when `args` ask for
    it, and the message's reason and fix."""

    flags: str
    example: tuple[str, ...]
    applies: Callable[[TrainArgs], bool]
    reason: str
    without: tuple[str, ...] = ()
    # Megatron flags `dtmega train` does not parse that ask for this feature: names, or prefixes
    # ending in "*"; the parser refuses them with this row instead of "unrecognized arguments"
    unparsed: tuple[str, ...] = ()

    def names_flag(self, flag: str) -> bool:
        """Whether `flag` (a --name, without its value) is one of this row's unparsed flags."""
        name = flag.split("=", 1)[0]
        return any(name.startswith(pattern[:-1]) if pattern.endswith("*") else name == pattern
                   for pattern in self.unparsed)


def _never(args: TrainArgs) -> bool:
    """`applies` of a row whose flags the parser refuses (they never reach TrainArgs)."""
    return False


def _uniform_groups(args: TrainArgs) -> bool:
    return (args.recompute_granularity == "full" and args.recompute_method in (None, "uniform")
            and args.recompute_num_layers not in (None, 1))


def _gpt_features_elsewhere(args: TrainArgs) -> bool:
    """A line sized by flags that selects Qwen3 or DeepSeek (whose blocks are Llama-shaped) and
    asks for GPT-block features (dtmega/models/gpt/megatron.py)."""
    from dtmega.models.gpt.megatron import gpt_features

    sized = args.model is None and not args.load_hf and args.num_layers is not None
    return sized and args.multi_latent_attention and bool(gpt_features(args))


_MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rotary_scaling_factor",
              "mscale", "mscale_all_dim")



def _has_multi_token_prediction(args) -> bool:
    """Whether the run's model family has Megatron's multi-token prediction (dtmega/models/family.py,
    `Family.multi_token_prediction`): the family of --model, of --load-hf's architecture, or the
    one Megatron's flags select (--multi-latent-attention: DeepSeek)."""
    from pathlib import Path

    from dtmega.models import family_for_flags, model_families, model_family
    from dtmega.models.registry import model_spec
    from dtmega.safe_files import read_regular_json

    if args.load_hf:
        try:
            named = read_regular_json(Path(args.load_hf) / "config.json", "config.json of the model")["architectures"] or []
        except (OSError, ValueError, KeyError, TypeError):
            return False  # --load-hf's own checks name the problem
        return any(family.multi_token_prediction for family in model_families()
                   for architecture in family.hf if len(named) == 1 and named[0] in architecture.names)
    if args.model is None:
        return family_for_flags(args).multi_token_prediction
    try:
        family = model_family(model_spec(args.model).family)
    except KeyError:
        return False
    return family is not None and family.multi_token_prediction


NOT_BUILT: tuple[NotBuilt, ...] = (
    NotBuilt("GPT-block features with --multi-latent-attention",
             ("--multi-latent-attention", "--qk-layernorm", "--normalization", "LayerNorm"), _gpt_features_elsewhere,
             "DeepSeek's blocks are Llama-shaped (SwiGLU, RMSNorm, RoPE, no biases, no dropout); LayerNorm, learned "
             "positions, biases, GeLU and dropout are built in the GPT family only, whose attention is not latent. "
             "Fix: --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
             "--attention-dropout 0 --hidden-dropout 0 with --multi-latent-attention (as Megatron's DeepSeek scripts "
             "pass them)",
             without=()),
    NotBuilt("--recompute-method uniform --recompute-num-layers N (N > 1)",
             ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"),
             _uniform_groups,
             "one checkpoint per group of N blocks is not supported yet (each block is its own unit). Fix: "
             "--recompute-num-layers 1, or --recompute-method block"),
    NotBuilt("--rotary-percent below 1 with --model or --load-hf", ("--model", "llama3-8b", "--rotary-percent", "0.5"),
             lambda a: a.rotary_percent != 1.0 and bool(a.model or a.load_hf),
             "partial rotary embeddings are built for models sized by Megatron's flags (the GPT family's "
             "blocks); a named or Hugging Face model keeps its own RoPE. Fix: --rotary-percent 1.0, or size the "
             "model with --num-layers/--hidden-size/... flags"),
    NotBuilt("--rotary-seq-len-interpolation-factor above 1", ("--rotary-seq-len-interpolation-factor", "2"),
             lambda a: (a.rotary_seq_len_interpolation_factor or 1) != 1,
             "RoPE position interpolation is not supported yet (--use-rope-scaling gives Llama 3.1's frequency "
             "scaling). Fix: leave the flag out, or --rotary-seq-len-interpolation-factor 1"),
    NotBuilt("--tp-comm-overlap", ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"),
             lambda a: a.tp_comm_overlap,
             "overlapping the tensor-parallel all-gathers and reduce-scatters with the GEMMs (Transformer Engine's "
             "userbuffers) is not supported yet. Fix: leave --tp-comm-overlap out (TP communication then runs between "
             "the GEMMs)"),
    NotBuilt("--ckpt-format torch", ("--ckpt-format", "torch"), lambda a: a.ckpt_format == "torch",
             "Megatron's legacy per-rank torch.save checkpoints are not written (dtmega's are sharded DCP directories, "
             "loadable under any plan). Fix: --ckpt-format torch_dist"),
    NotBuilt("--moe-flex-dispatcher-backend",
             ("--num-experts", "4", "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"),
             lambda a: a.moe_flex_dispatcher_backend is not None,
             "DeepEP's and HybridEP's kernels are not supported (the flex dispatcher runs as plain all-to-alls: one row "
             "per token and destination rank each way). Fix: leave --moe-flex-dispatcher-backend out"),
    NotBuilt("--q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim --rotary-scaling-factor "
             "--mscale --mscale-all-dim --rope-type without --multi-latent-attention", ("--kv-lora-rank", "16"),
             lambda a: not a.multi_latent_attention and (a.rope_type is not None or any(
                 getattr(a, name) is not None for name in _MLA_SIZES)),
             "these flags size multi-latent attention (and its YaRN RoPE); the Llama's grouped-query attention has no "
             "latent. Fix: add --multi-latent-attention --qk-layernorm (DeepSeek's attention), or leave them out"),
    NotBuilt("--mtp-num-layers --mtp-loss-scaling-factor without a DeepSeek model", ("--mtp-num-layers", "1"),
             lambda a: (a.mtp_num_layers is not None or a.mtp_loss_scaling_factor is not None)
             and not _has_multi_token_prediction(a),
             "multi-token prediction is built for the DeepSeek family only. Fix: --model deepseek-v3 (or another "
             "deepseek-* size, or --multi-latent-attention), or leave --mtp-num-layers and --mtp-loss-scaling-factor "
             "out (next-token loss only)"),
    NotBuilt("--moe-router-dtype fp64", ("--num-experts", "4", "--moe-router-dtype", "fp64"),
             lambda a: a.moe_router_dtype == "fp64",
             "a float64 router for a lower-precision model is not supported yet (the router runs in fp32 for bf16 and "
             "fp16 models). Fix: --moe-router-dtype fp32, or leave it out"),
    NotBuilt("--moe-permute-fusion", ("--num-experts", "4", "--moe-permute-fusion"), lambda a: a.moe_permute_fusion,
             "Transformer Engine's fused token permutation is not supported yet. Fix: leave the flag out (tokens are "
             "permuted with torch's index operations)"),
    NotBuilt("--moe-router-force-load-balancing", ("--num-experts", "4", "--moe-router-force-load-balancing"),
             lambda a: a.moe_router_force_load_balancing,
             "forcing an even routing for benchmarks is not supported yet. Fix: leave the flag out"),
    NotBuilt("--recompute-modules other than core_attn", ("--recompute-granularity", "selective",
                                                          "--recompute-modules", "mlp"),
             lambda a: a.recompute_modules is not None and list(a.recompute_modules) != ["core_attn"],
             "choosing the modules selective recompute covers is not supported yet (it recomputes the attention "
             "core, Megatron's core_attn). Fix: leave --recompute-modules out, or --recompute-modules core_attn"),
    NotBuilt("--data-parallel-sharding-strategy optim|optim_grads",
             ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim"),
             lambda a: a.use_megatron_fsdp and a.data_parallel_sharding_strategy in ("optim", "optim_grads"),
             "sharding only the optimizer state (ZeRO-1) or it and the gradients (ZeRO-2) is not supported yet. Fix: "
             "--data-parallel-sharding-strategy optim_grads_params (FSDP2, ZeRO-3) or no_shard (DDP)"),
    NotBuilt("--fsdp-double-buffer --use-nccl-ub", ("--use-megatron-fsdp", "--use-nccl-ub"),
             lambda a: a.fsdp_double_buffer or a.use_nccl_ub,
             "Megatron-FSDP's double buffers and NCCL user-buffer registration are not supported yet. Fix: leave "
             "them out (FSDP2 allocates its own communication buffers)"),
    NotBuilt("--enable-cuda-graph --cuda-graph-scope --cuda-graph-impl --cuda-graph-modules", ("--enable-cuda-graph",),
             lambda a: a.enable_cuda_graph or a.cuda_graph_scope is not None,
             "the trainer's step is not captured in CUDA graphs yet (its gradient clipping, skipped steps and loss "
             "scaling run between the compiled parts). Fix: leave the flags out, and --compile the blocks; from "
             "Python, dtmega.capture_step(pm, optimizer) compiles forward, backward and the optimizer step as one "
             "program with CUDA graphs where shapes are static (docs/kernels.md)",
             unparsed=("--cuda-graph-*", "--te-rng-tracker")),
    NotBuilt("--megatron-fsdp-main-grads-dtype bf16", ("--use-megatron-fsdp", "--megatron-fsdp-main-grads-dtype", "bf16"),
             lambda a: a.megatron_fsdp_main_grads_dtype == "bf16",
             "accumulating gradients in bf16 is not supported yet (they accumulate in fp32). Fix: "
             "--megatron-fsdp-main-grads-dtype fp32, or leave it out"),
    NotBuilt("--rampup-batch-size --step-batch-size-schedule", ("--rampup-batch-size", "4", "4", "64"),
             lambda a: a.rampup_batch_size is not None or a.step_batch_size_schedule is not None,
             "a growing batch size is not supported yet. Fix: leave the schedule out (--global-batch-size is used "
             "from the first step)"),
    NotBuilt("--decoupled-lr/--decoupled-min-lr", ("--decoupled-lr", "5e-4"),
             lambda a: a.decoupled_lr is not None or a.decoupled_min_lr is not None,
             "a separate learning rate for the embedding and output layer is not supported yet. Fix: leave "
             "--decoupled-lr and --decoupled-min-lr out (every parameter follows --lr)"),
    NotBuilt("--profile", ("--profile",), lambda a: a.profile,
             "the step profiler is not supported yet. Fix: leave --profile out (torch.profiler around a few steps of "
             "your own script does it meanwhile)"),
    NotBuilt("--fp8-margin above 0", ("--fp8-format", "hybrid", "--fp8-margin", "1"), lambda a: a.fp8_margin > 0,
             "an FP8 scale margin is not supported yet (scales use the full range). Fix: --fp8-margin 0"),
    NotBuilt("--expert-tensor-parallel-size other than TP or 1", ("--num-experts", "4", "--expert-tensor-parallel-size",
                                                                   "2", "--tensor-model-parallel-size", "1"),
             lambda a: a.num_experts and a.expert_tensor_parallel_size not in (None, 1, a.tensor_model_parallel_size),
             "the experts' hidden dim is split over all tensor-parallel ranks (ETP = TP) or none (ETP 1: experts "
             "whole, folded over TP x EP); other expert tensor-parallel sizes are not supported yet. Fix: leave "
             "--expert-tensor-parallel-size unset (= TP) or 1"),
    NotBuilt("--moe-router-load-balancing-type global_aux_loss", ("--num-experts", "4", "--moe-router-load-balancing-type",
                                                                   "global_aux_loss"),
             lambda a: a.moe_router_load_balancing_type == "global_aux_loss",
             "Megatron's global auxiliary loss (token counts averaged over the data-parallel ranks and micro-batches "
             "of a step) is not supported yet. Fix: aux_loss (over the micro-batch) or seq_aux_loss"),
    NotBuilt("--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes", ("--cp-comm-type", "a2a+p2p"),
             lambda a: a.cp_comm_type == "a2a+p2p", unparsed=("--hierarchical-context-parallel-sizes",),
             reason="hierarchical context parallelism (all-to-all inside a node, ring across) is not supported yet. "
                    "Fix: --cp-comm-type p2p, all_gather or a2a"),
    NotBuilt("--optimizer muon --muon-*", ("--optimizer", "muon"), lambda a: a.optimizer == "muon",
             unparsed=("--muon-*", "--no-use-layer-wise-param-layout"),
             reason="the Muon optimizer is not built yet. Fix: --optimizer adam"),
    NotBuilt("--megatron-fsdp-main-params-dtype bf16|fp16|auto --outer-dp-sharding-strategy optim",
             ("--use-megatron-fsdp", "--megatron-fsdp-main-params-dtype", "bf16"),
             lambda a: (a.megatron_fsdp_main_params_dtype not in (None, "fp32")
                        or a.outer_dp_sharding_strategy == "optim"),
             "master weights are always fp32 here, and HSDP's outer replicas never shard the optimizer state. Fix: "
             "--megatron-fsdp-main-params-dtype fp32, --outer-dp-sharding-strategy no_shard, or leave them out"),
    NotBuilt("--position-embedding-type yarn", ("--position-embedding-type", "yarn"),
             lambda a: a.position_embedding_type == "yarn",
             "YaRN-scaled RoPE as a GPT position embedding (GPT-OSS's) is not built yet. Fix: --position-embedding-type "
             "rope"),
    NotBuilt("--context-parallel-size > 1 with --attention-dropout > 0",
             ("--context-parallel-size", "2", "--attention-dropout", "0.1"),
             lambda a: a.context_parallel_size > 1 and bool(a.attention_dropout),
             "context parallelism's attention kernels (ring, all-gather, all-to-all) compute no dropout on the "
             "attention probabilities yet. Fix: --attention-dropout 0 (hidden dropout works under CP)"),
    NotBuilt("--inference-* --prompts --num-tokens-to-generate --temperature --top_k --transformer-impl "
             "inference_optimized (Megatron's inference engines)",
             ("--inference-max-seq-length", "4096"), lambda a: a.transformer_impl == "inference_optimized",
             unparsed=("--inference-*", "--incoming-requests-*", "--prompts", "--prompt-file*", "--num-tokens-to-generate",
                       "--temperature", "--top_k", "--top_p", "--top-n-logprobs", "--return-log-probs",
                       "--max-tokens-to-oom", "--output-path", "--output-every-n-results", "--termination-id",
                       "--stop-words", "--enable-chunked-prefill", "--flash-decode", "--use-legacy-static-engine",
                       "--use-coordinator", "--async-mode", "--decode-only-cuda-graphs", "--use-flashinfer-fused-rope",
                       "--moe-pad-experts-for-cuda-graph-inference", "--suspend-*", "--moe-enable-routing-replay",
                       "--no-use-tokenizer-model-from-checkpoint-args"),
             reason="`dtmega train` trains; Megatron's static and dynamic inference engines (their batching, CUDA "
                    "graphs, sampling and request flags) are not built into it. Fix: `dtmega generate` or `dtmega "
                    "serve` (docs/serving.md) on the checkpoint"),
    NotBuilt("--use-checkpoint-args", ("--use-checkpoint-args",), _never, unparsed=("--use-checkpoint-args",),
             reason="the model's flags come from the command line; reading them from the checkpoint's saved arguments "
                    "is not supported yet (a resume checks them against the checkpoint's model). Fix: pass the model's "
                    "flags"),
    NotBuilt("--perform-rl-step --grpo-* --rl-* (Megatron's RL)", ("--perform-rl-step",), _never,
             unparsed=("--perform-rl-step", "--grpo-*", "--rl-*", "--no-rl-*", "--langrl-*", "--refit-method"),
             reason="reinforcement learning (GRPO rollouts and refits) is not built yet. Fix: train with `dtmega "
                    "train` (pretraining, --sft)"),
    NotBuilt("--defer-embedding-wgrad-compute --wgrad-deferral-limit --delay-wgrad-compute",
             ("--defer-embedding-wgrad-compute",), _never,
             unparsed=("--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "--delay-wgrad-compute"),
             reason="deferring weight-gradient GEMMs to overlap communication is not built yet (a speed feature: the "
                    "gradients are the same). Fix: leave the flags out"),
    NotBuilt("--overlap-moe-expert-parallel-comm --overlap-param-gather-with-optimizer-step "
             "--microbatch-group-size-per-virtual-pipeline-stage --overlap-p2p-communication-warmup-flush",
             ("--overlap-moe-expert-parallel-comm",), _never,
             unparsed=("--overlap-moe-expert-parallel-comm", "--overlap-param-gather-with-optimizer-step",
                       "--microbatch-group-size-per-virtual-pipeline-stage", "--overlap-p2p-communication-warmup-flush"),
             reason="these overlaps of communication with compute are not built yet (speed features: training is the "
                    "same without them). Fix: leave the flags out"),
    NotBuilt("--fine-grained-activation-offloading --offload-modules --use-transformer-engine-op-fuser --moe-router-fusion "
             "--tp-comm-overlap-cfg", ("--fine-grained-activation-offloading",), _never,
             unparsed=("--fine-grained-activation-offloading", "--offload-modules", "--use-transformer-engine-op-fuser",
                       "--moe-router-fusion", "--tp-comm-overlap-cfg"),
             reason="Transformer Engine's activation offloading, op fuser, fused router and TP-overlap configuration are "
                    "not built yet (memory and speed features). Fix: leave the flags out (--recompute-granularity or "
                    "--cpu-optimizer for memory)"),
    NotBuilt("--error-injection-rate --error-injection-type", ("--error-injection-rate", "100"), _never,
             unparsed=("--error-injection-*",),
             reason="Megatron's re-run engine injects faults to test itself; dtmega has no re-run engine (non-finite "
                    "steps are skipped and counted, --check-for-spiky-loss re-runs a spike). Fix: leave the flags out"),
    NotBuilt("--export-kd-cfg --export-kd-teacher-load --export-te-mcore-model (ModelOpt distillation)",
             ("--export-te-mcore-model",), _never, unparsed=("--export-*",),
             reason="knowledge distillation from a teacher checkpoint (NVIDIA ModelOpt) is not built yet. Fix: leave "
                    "the flags out"),
    NotBuilt("--use-mup --mup-base-hidden-size", ("--use-mup",), _never, unparsed=("--use-mup", "--mup-*"),
             reason="maximal-update parametrization (μP) is not built yet. Fix: leave the flags out"),
    NotBuilt("--experimental-attention-variant --linear-attention-freq --attention-output-gate --dsa-indexer-*",
             ("--experimental-attention-variant", "gated_delta_net"), _never,
             unparsed=("--experimental-attention-variant", "--linear-*", "--attention-output-gate",
                       "--apply-wd-to-qk-layernorm", "--moe-shared-expert-gate", "--dsa-*"),
             reason="Megatron's experimental attention variants (gated delta net, DeepSeek sparse attention) are not "
                    "built yet. Fix: leave the flags out (softmax attention)"),
    NotBuilt("--disable-gloo-process-groups", ("--disable-gloo-process-groups",), _never,
             unparsed=("--disable-gloo-process-groups",),
             reason="dtmega makes a gloo group for --async-save's background writer (and runs on gloo on a CPU); "
                    "running without gloo groups is not supported yet. Fix: leave it out"),
    NotBuilt("--cross-entropy-fusion-impl te", ("--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"),
             lambda a: a.cross_entropy_loss_fusion and a.cross_entropy_fusion_impl == "te",
             "Transformer Engine's fused cross entropy is not supported yet. Fix: --cross-entropy-fusion-impl native "
             "(dtmega's fused linear cross entropy)"),
)


def unparsed_refusal(unknown: list[str]) -> str | None:
    """The refusal of the unparsed flags among `unknown` (argparse's unrecognized arguments, values
    included) that rows of NOT_BUILT name, each row with its reason; the other unknown flags are
    listed after it. None when no row names any of them."""
    flags = [token for token in unknown if token.startswith("--")]
    rows = [item for item in NOT_BUILT if any(item.names_flag(flag) for flag in flags)]
    if not rows:
        return None
    rest = [flag for flag in flags if not any(item.names_flag(flag) for item in NOT_BUILT)]
    tail = f" (and unrecognized arguments: {' '.join(rest)})" if rest else ""
    if len(rows) == 1:
        return f"{rows[0].flags}: {rows[0].reason}{tail}"
    lines = "".join(f"\n  - {item.flags}: {item.reason}" for item in rows)
    return (f"{len(rows)} features this line asks for are not built yet (docs/training.md, \"Not built yet\"); each "
            f"with its fix:{lines}{tail}")


def refuse_not_built(args: TrainArgs) -> None:
    """ArgumentError listing every flag of `args` that asks for a feature in NOT_BUILT, each with
    its reason and fix, so one dry run shows all of a line's refusals (as argparse lists every
    unknown flag at once). One row is one line, as before; several are one line each under a
    summary."""
    refused = [item for item in NOT_BUILT if item.applies(args)]
    if len(refused) == 1:
        raise ArgumentError(f"{refused[0].flags}: {refused[0].reason}")
    if refused:
        rows = "".join(f"\n  - {item.flags}: {item.reason}" for item in refused)
        raise ArgumentError(f"{len(refused)} features this line asks for are not built yet (docs/training.md, \"Not "
                            f"built yet\"); each with its fix:{rows}")
