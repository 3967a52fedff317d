"""Megatron's multi-latent-attention flags as dtmega's DeepSeek model: `--multi-latent-attention`
with `--q-lora-rank`, `--kv-lora-rank`, `--qk-head-dim`, `--qk-pos-emb-head-dim`,
`--v-head-dim`, `--rotary-scaling-factor`, `--mscale`, `--mscale-all-dim` beside the usual size
flags (`--num-layers`, `--hidden-size`, `--num-attention-heads`, `--ffn-hidden-size`, the
`--moe-*` flags, `--mtp-num-layers`) build a DeepSeekConfig, as Megatron's launch scripts for
DeepSeek-V2/V3 describe their models.

Megatron's defaults are kept: kv_lora_rank 32, qk-head-dim 128, qk-pos-emb-head-dim 64,
v-head-dim 128, no query latent; RoPE is YaRN (MLA's default `--rope-type`) with Megatron's
TransformerConfig defaults for what has no flag (original context 4096 positions, beta_fast 32,
beta_slow 1); a --rotary-scaling-factor of 1 stretches nothing, so that model has plain RoPE.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from dtmega.kernels.errors import DtmegaError
from dtmega.models.family import MegatronSizing
from dtmega.train.arg_fields import ArgumentError

if TYPE_CHECKING:
    from dtmega.train.args import TrainArgs

# Megatron's defaults for the flags a launch line leaves out
MEGATRON_MLA_DEFAULTS = {"kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128,
                         "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
YARN_ORIGINAL_POSITIONS = 4096  # Megatron's MLATransformerConfig.original_max_position_embeddings

MLA_SIZE_FLAGS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                  "rotary_scaling_factor", "mscale", "mscale_all_dim")


def _given(args: TrainArgs, name: str) -> Any:
    value = getattr(args, name)
    return MEGATRON_MLA_DEFAULTS[name] if value is None else value


def mla_config(args: TrainArgs, vocab_size: int) -> Any:
    """The DeepSeekConfig Megatron's flags describe (`vocab_size`: the padded vocabulary);
    ArgumentError naming the flag for what does not fit."""
    from dtmega.models.deepseek.config import DeepSeekConfig, YarnScaling
    from dtmega.train.model_flags import moe_config

    missing = [f"--{k.replace('_', '-')}" for k in ("num_layers", "hidden_size", "num_attention_heads")
               if getattr(args, k) is None]
    if missing:
        raise ArgumentError(f"--multi-latent-attention needs {', '.join(missing)} (or a preset: --model deepseek-v3)")
    if not args.qk_layernorm:
        raise ArgumentError("--multi-latent-attention without --qk-layernorm: Megatron then leaves the query and "
                            "key/value latents unnormalized, which dtmega's MLA (DeepSeek's) does not build. Fix: add "
                            "--qk-layernorm (as DeepSeek-V2/V3's launch scripts do)")
    factor = float(_given(args, "rotary_scaling_factor"))
    if args.rope_type == "rope" and factor != 1.0:
        raise ArgumentError(f"--rotary-scaling-factor {factor} with --rope-type rope: the factor stretches YaRN RoPE. "
                            "Fix: --rope-type yarn (MLA's default), or leave --rotary-scaling-factor out")
    yarn = None
    if args.rope_type != "rope" and factor > 1.0:
        yarn = YarnScaling(factor=factor, original_max_seq_len=YARN_ORIGINAL_POSITIONS,
                           mscale=float(_given(args, "mscale")), mscale_all_dim=float(_given(args, "mscale_all_dim")))
    ffn = args.ffn_hidden_size or int((4 * args.hidden_size * 2 / 3) / 64) * 64
    try:
        return DeepSeekConfig(
            dim=args.hidden_size, n_layers=args.num_layers, n_heads=args.num_attention_heads, vocab_size=vocab_size,
            ffn_dim=ffn, q_lora_rank=args.q_lora_rank, kv_lora_rank=int(_given(args, "kv_lora_rank")),
            qk_nope_head_dim=int(_given(args, "qk_head_dim")), qk_rope_head_dim=int(_given(args, "qk_pos_emb_head_dim")),
            v_head_dim=int(_given(args, "v_head_dim")), norm_eps=args.norm_epsilon, rope_theta=args.rotary_base,
            yarn=yarn, max_seq_len=args.max_position_embeddings or args.seq_length,
            tie_embeddings=not args.untie_embeddings_and_output_weights, init_std=args.init_method_std,
            moe=moe_config(args, ffn), mtp_num_layers=args.mtp_num_layers or 0,
            mtp_loss_scaling_factor=0.1 if args.mtp_loss_scaling_factor is None else args.mtp_loss_scaling_factor,
        )
    except DtmegaError as error:
        message = str(error).replace("invalid DeepSeekConfig: ", "")
        for flag, field in (("--qk-pos-emb-head-dim", "qk_rope_head_dim"), ("--qk-head-dim", "qk_nope_head_dim"),
                            ("--kv-lora-rank", "kv_lora_rank"), ("--q-lora-rank", "q_lora_rank"),
                            ("--v-head-dim", "v_head_dim"), ("--mtp-num-layers", "mtp_num_layers")):
            message = message.replace(field, flag)
        raise ArgumentError(f"--multi-latent-attention: {message}") from None


def flags_config(args: TrainArgs, tokenizer_vocab: int) -> Any:
    """The DeepSeekConfig of a line with --multi-latent-attention (the vocabulary padded as
    Megatron pads it)."""
    from dtmega.train.model_flags import padded_vocab

    return mla_config(args, padded_vocab(tokenizer_vocab, args))


def named_size_flags(config: Any, args: TrainArgs, source: str) -> Any:
    """Megatron's flags a named DeepSeek size (--model deepseek-v3) still takes: --mtp-num-layers,
    --mtp-loss-scaling-factor, --moe-router-num-groups and --moe-router-group-topk. The MLA flags
    size a model of their own: with a named size they are refused, not dropped."""
    if args.multi_latent_attention:
        raise ArgumentError(f"{source} with --multi-latent-attention: the preset and the flags both size "
                            f"the model. Fix: one of them ({source} is multi-latent already)")
    changes: dict[str, Any] = {}
    if args.mtp_num_layers is not None:
        changes["mtp_num_layers"] = args.mtp_num_layers
    if args.mtp_loss_scaling_factor is not None:
        changes["mtp_loss_scaling_factor"] = args.mtp_loss_scaling_factor
    try:
        if (args.moe_router_num_groups, args.moe_router_group_topk) != (None, None):
            changes["moe"] = dataclasses.replace(config.moe, num_groups=args.moe_router_num_groups,
                                                 group_topk=args.moe_router_group_topk)
        return config.replace(**changes) if changes else config
    except DtmegaError as error:
        raise ArgumentError(f"{source}: {error}") from None


DEEPSEEK_FLAGS = MegatronSizing(model="deepseek-v3", selects=lambda args: bool(args.multi_latent_attention),
                                config=flags_config, adjust=named_size_flags, flag="--multi-latent-attention")
