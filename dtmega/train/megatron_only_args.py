"""A section of `dtmega train`'s arguments for flags of Megatron's launch scripts (DeepSeek-V3's in
particular) that name Megatron-only machinery: Megatron-FSDP's options, taken where FSDP2 does
the same and refused otherwise; and the settings of features dtmega does not have yet
(multi-latent attention, multi-token prediction, group-limited routing, ...), parsed so that a
launch line gets the not-built table's reason (not_built.py) instead of "unrecognized"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dtmega.train.arg_fields import ArgumentError, opt

# Megatron-FSDP's sharding strategies as dtmega's data-parallel modes (ZeRO-1/2 have none)
SHARDING_STRATEGIES = {"no_shard": "ddp", "optim": None, "optim_grads": None, "optim_grads_params": "fsdp"}


@dataclass(frozen=True)
class MegatronOnlyArgs:
    """Megatron-FSDP and the settings of not-yet-built features."""
    # sizes and counts that must be >= 1 when given
    at_least_one: ClassVar[tuple[str, ...]] = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                               "v_head_dim", "moe_router_group_topk",
                                               "moe_router_num_groups")

    use_megatron_fsdp: bool = opt(False, "Megatron's own FSDP: = --data-parallel fsdp here (FSDP2), with "
                                         "--data-parallel-sharding-strategy")
    data_parallel_sharding_strategy: str | None = opt(None, "with --use-megatron-fsdp: no_shard (= ddp), "
                                                            "optim_grads_params (= fsdp); optim and optim_grads "
                                                            "(ZeRO-1/2) are not supported yet",
                                                      tuple(SHARDING_STRATEGIES))
    megatron_fsdp_grad_comm_dtype: str | None = opt(None, "Megatron-FSDP's gradient reduction dtype: bf16 = "
                                                          "--grad-reduce-in-bf16, fp32 = the default",
                                                    ("fp32", "bf16"))
    megatron_fsdp_main_grads_dtype: str | None = opt(None, "Megatron-FSDP's accumulated-gradient dtype (only fp32, "
                                                           "dtmega's, is supported)", ("fp32", "bf16"))
    megatron_fsdp_main_params_dtype: str | None = opt(None, "Megatron-FSDP's master-weight dtype (only fp32, dtmega's, "
                                                            "is supported)", ("fp32", "bf16", "fp16", "auto"))
    outer_dp_sharding_strategy: str | None = opt(None, "Megatron-FSDP's HSDP outer replicas: no_shard (= HSDP's "
                                                       "replicas); optim is not supported yet", ("no_shard", "optim"))
    fsdp_double_buffer: bool = opt(False, "Megatron-FSDP's double-buffered all-gathers (not supported yet)")
    use_nccl_ub: bool = opt(False, "NCCL user-buffer registration (not supported yet)")
    enable_cuda_graph: bool = opt(False, "Megatron's CUDA graphs of the training step (not supported by the trainer "
                                         "yet; dtmega.capture_step from Python)")
    cuda_graph_scope: str | None = opt(None, "what Megatron captures in CUDA graphs (not supported by the trainer yet)")
    dist_ckpt_strictness: str = opt("raise_all", "how --load treats keys missing from or unexpected in the "
                                                 "checkpoint: raise_* stop the load naming them, log_* list them "
                                                 "and go on (a key the checkpoint lacks keeps its initialized "
                                                 "value: log_all, return_all, ignore_all), the rest go on silently; "
                                                 "a shape mismatch always stops it",
                                    ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                                     "raise_all", "return_unexpected", "return_all", "ignore_all"))
    recompute_modules: list[str] | None = opt(None, "modules selective recompute covers (only core_attn, Megatron's "
                                                    "default and dtmega's selective recompute, is supported)")
    multi_latent_attention: bool = opt(False, "DeepSeek's multi-latent attention: the model is dtmega's DeepSeek "
                                              "family, sized by these flags (with --qk-layernorm)")
    q_lora_rank: int | None = opt(None, "MLA: query latent rank (default: none, a full-rank query projection)")
    kv_lora_rank: int | None = opt(None, "MLA: key/value latent rank (Megatron's default 32)")
    qk_head_dim: int | None = opt(None, "MLA: query/key head dimension without RoPE (default 128)")
    qk_pos_emb_head_dim: int | None = opt(None, "MLA: query/key RoPE head dimension (default 64)")
    v_head_dim: int | None = opt(None, "MLA: value head dimension (default 128)")
    rotary_scaling_factor: float | None = opt(None, "MLA: YaRN RoPE stretch factor (default 1: no stretch)")
    mscale: float | None = opt(None, "MLA: YaRN mscale (default 1.0)")
    mscale_all_dim: float | None = opt(None, "MLA: YaRN mscale over all dims (default 0.0)")
    rope_type: str | None = opt(None, "MLA's RoPE: yarn (its default) or rope (only with --multi-latent-attention)",
                                 ("rope", "yarn"))
    mtp_num_layers: int | None = opt(None, "multi-token prediction depths (DeepSeek models: --model deepseek-*)")
    mtp_loss_scaling_factor: float | None = opt(None, "multi-token prediction loss weight (DeepSeek models)")
    moe_router_group_topk: int | None = opt(None, "group-limited routing: the best groups each token's experts "
                                                  "come from")
    moe_router_num_groups: int | None = opt(None, "group-limited routing: equal groups of consecutive experts")
    moe_router_dtype: str | None = opt(None, "router precision: fp32 is dtmega's for bf16/fp16 models (fp64 is "
                                             "not supported)", ("fp32", "fp64"))
    moe_permute_fusion: bool = opt(False, "Transformer Engine's fused token permutation (not supported yet)")
    moe_router_force_load_balancing: bool = opt(False, "route tokens evenly regardless of the router, for "
                                                       "benchmarks (not supported yet)")
    moe_flex_dispatcher_backend: str | None = opt(None, "the flex dispatcher's kernels (not supported yet)",
                                                  ("deepep", "hybridep"))
    rampup_batch_size: list[str] | None = opt(None, "batch-size ramp-up: start, increment, samples (not supported "
                                                    "yet)")
    step_batch_size_schedule: str | None = opt(None, "batch-size schedule by consumed tokens (not supported yet)")

    def megatron_fsdp_mode(self) -> str | None:
        """The data-parallel mode --use-megatron-fsdp asks for (None without it); a sharding
        strategy without it is refused."""
        if not self.use_megatron_fsdp:
            if self.data_parallel_sharding_strategy is not None:
                raise ArgumentError("--data-parallel-sharding-strategy needs --use-megatron-fsdp. Fix: add it, or use "
                                    "--data-parallel ddp|fsdp|hsdp")
            return None
        return SHARDING_STRATEGIES[self.data_parallel_sharding_strategy or "optim_grads_params"]
