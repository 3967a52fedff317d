"""Megatron's model flags as configs: the padded vocabulary (--make-vocab-size-divisible-by,
--padded-vocab-size), the Llama-like decoder they size (--num-layers, --hidden-size,
--num-attention-heads, --group-query-attention, --kv-channels, --qk-layernorm, ...) and the
--moe-* options. The model families' Megatron sizing (dtmega/models/<family>/megatron.py) calls
these; the module imports nothing of the trainer but its argument types, so a family can."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import TYPE_CHECKING

from dtmega.kernels.errors import DtmegaError
from dtmega.models.llama.config import LlamaConfig, RopeScaling
from dtmega.models.moe_config import MoEConfig
from dtmega.train.arg_fields import ArgumentError
from dtmega.train.moe_args import MoEArgs

if TYPE_CHECKING:
    from dtmega.train.args import TrainArgs


def padded_vocab(vocab: int, args: TrainArgs) -> int:
    """Megatron's padding: a multiple of --make-vocab-size-divisible-by x TP size, or
    --padded-vocab-size as given (checked: it holds the tokenizer's ids and splits over TP)."""
    tp = args.tensor_model_parallel_size
    if args.padded_vocab_size is not None:
        if args.padded_vocab_size < vocab or args.padded_vocab_size % tp:
            raise ArgumentError(f"--padded-vocab-size {args.padded_vocab_size} must be at least the tokenizer's {vocab} "
                                f"ids and a multiple of the TP size {tp}. Fix: --padded-vocab-size "
                                f"{-(-vocab // tp) * tp} or more (a multiple of {tp}), or leave it out")
        return args.padded_vocab_size
    multiple = args.make_vocab_size_divisible_by * tp
    return -(-vocab // multiple) * multiple


def model_config(args: TrainArgs, tokenizer_vocab: int) -> LlamaConfig:
    """The Llama-like decoder the arguments describe, with the tokenizer's (padded) vocabulary:
    `--qk-layernorm` puts RMSNorm on each query and key head (Qwen3's), `--kv-channels` gives
    heads a width of their own (Megatron's default: --hidden-size / --num-attention-heads)."""
    required = {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
                "num_attention_heads": args.num_attention_heads}
    missing = [f"--{k.replace('_', '-')}" for k, v in required.items() if v is None]
    if missing:
        raise ArgumentError(f"the model needs {', '.join(missing)} (or a preset: --model llama3-8b)")
    heads = args.num_attention_heads
    kv_heads = args.num_query_groups if args.group_query_attention else heads
    if args.group_query_attention and not args.num_query_groups:
        raise ArgumentError("--group-query-attention needs --num-query-groups")
    ffn = args.ffn_hidden_size or int((4 * args.hidden_size * 2 / 3) / 64) * 64
    positions = args.max_position_embeddings
    if args.seq_length < 1:
        raise ArgumentError(f"--seq-length must be >= 1, got {args.seq_length}")
    if positions is not None and args.seq_length > positions:
        raise ArgumentError(
            f"--seq-length {args.seq_length} is longer than --max-position-embeddings {positions} (the RoPE table): "
            f"positions past {positions - 1} have no rotation. Fix: raise --max-position-embeddings to at least "
            f"{args.seq_length}, or leave it unset (the table then follows --seq-length)"
        )
    head_dim = args.kv_channels
    if head_dim is not None and head_dim * heads == args.hidden_size:
        head_dim = None  # the default width, said explicitly
    check_heads(args.hidden_size, heads, kv_heads, args.group_query_attention, explicit_head_dim=head_dim is not None)
    try:
        return LlamaConfig(
            dim=args.hidden_size, n_layers=args.num_layers, n_heads=heads, n_kv_heads=kv_heads,
            vocab_size=padded_vocab(tokenizer_vocab, args), ffn_dim=ffn, norm_eps=args.norm_epsilon,
            rope_theta=args.rotary_base, rope_scaling=RopeScaling() if args.use_rope_scaling else None,
            max_seq_len=args.max_position_embeddings or args.seq_length,
            tie_embeddings=not args.untie_embeddings_and_output_weights, init_std=args.init_method_std,
            moe=moe_config(args, ffn), qk_norm=args.qk_layernorm, kv_channels=head_dim,
        )
    except ValueError as error:
        raise ArgumentError(str(error).replace("kv_channels", "--kv-channels")) from None


def check_heads(width: int, heads: int, kv_heads: int, grouped: bool, explicit_head_dim: bool = False) -> None:
    """The head arithmetic in flag terms (LlamaConfig would say it in its field names); with
    --kv-channels the width need not divide among the heads."""
    if width % heads and not explicit_head_dim:
        fits = [n for n in range(1, min(width, 256) + 1) if width % n == 0 and abs(n - heads) <= heads][-3:]
        raise ArgumentError(f"--hidden-size {width} is not divisible by --num-attention-heads {heads} (every head gets "
                            f"the same width). Fix: --num-attention-heads {' or '.join(map(str, fits))}, or a "
                            f"--hidden-size that is a multiple of {heads}")
    if grouped and heads % kv_heads:
        fits = [n for n in range(1, heads + 1) if heads % n == 0]
        raise ArgumentError(f"--num-attention-heads {heads} is not divisible by --num-query-groups {kv_heads} (every "
                            f"query group needs the same number of heads). Fix: --num-query-groups one of "
                            f"{', '.join(map(str, fits))}")


# MoE options that mean something only with --num-experts (those the user sets: falsy defaults)
MOE_FLAGS = tuple(f.name for f in fields(MoEArgs) if f.name != "num_experts" and not f.default)


def _layer_pattern(text: str, n_layers: int) -> tuple[int, int]:
    """--moe-layer-freq as (first dense blocks, frequency): 'k', '([0]*K+[1]*M)' with K+M blocks,
    or Megatron's explicit list '[0, 0, 0, 1, ...]' (one 0/1 per block) of either form."""
    if text.strip().isdigit():
        return 0, int(text)
    listed = re.fullmatch(r"\[\s*([01](?:\s*,\s*[01])*)\s*\]", text.strip())
    if listed:
        flags = [int(v) for v in listed.group(1).split(",")]
        dense = flags.index(1) if 1 in flags else len(flags)
        for first, freq in ((dense, 1), *((0, k) for k in range(1, n_layers + 1))):
            if flags == [int(i >= first and (i - first) % freq == 0) for i in range(n_layers)]:
                return first, freq
        raise ArgumentError(f"--moe-layer-freq {text!r}: a list of {len(flags)} flags for --num-layers {n_layers} "
                            "blocks; dtmega builds K dense blocks then MoE blocks, or an MoE block every k-th. Fix: "
                            f"one 0/1 per block in one of those patterns, or '([0]*K+[1]*M)'")
    match = re.fullmatch(r"\(?\s*\[0\]\s*\*\s*(\d+)\s*\+\s*\[1\]\s*\*\s*(\d+)\s*\)?", text.strip())
    if not match or int(match.group(1)) + int(match.group(2)) != n_layers:
        raise ArgumentError(
            f"--moe-layer-freq {text!r}: use an integer k (every k-th block) or '([0]*K+[1]*M)' (K dense blocks, "
            f"then M MoE blocks, K+M = --num-layers {n_layers})"
        )
    return int(match.group(1)), 1


def moe_config(args: TrainArgs, ffn: int) -> MoEConfig | None:
    """The MoE options (Megatron's --moe-* flags), or None for a dense model."""
    if not args.num_experts:
        given = [f"--{name.replace('_', '-')}" for name in (*MOE_FLAGS, "moe_router_num_groups", "moe_router_group_topk")
                 if getattr(args, name)]
        if given:
            raise ArgumentError(f"{', '.join(given)} need(s) --num-experts (a mixture-of-experts model)")
        return None
    first_dense, freq = _layer_pattern(args.moe_layer_freq, args.num_layers)
    try:
        return _moe_config(args, ffn, first_dense, freq)
    except DtmegaError as error:  # the config's own checks (e.g. --moe-router-group-topk > groups), as one line
        raise ArgumentError(str(error).replace("invalid MoEConfig: ", "--moe-* flags: ")) from None


def _moe_config(args: TrainArgs, ffn: int, first_dense: int, freq: int) -> MoEConfig:
    return MoEConfig(
        num_experts=args.num_experts, top_k=args.moe_router_topk, ffn_dim=args.moe_ffn_hidden_size or ffn,
        layer_freq=freq, first_dense_layers=first_dense,
        shared_expert_ffn_dim=args.moe_shared_expert_intermediate_size or 0, score_func=args.moe_router_score_function,
        pre_softmax=args.moe_router_pre_softmax, route_scale=args.moe_router_topk_scaling_factor or 1.0,
        load_balancing=args.moe_router_load_balancing_type, aux_loss_coeff=args.moe_aux_loss_coeff,
        z_loss_coeff=args.moe_z_loss_coeff or 0.0, expert_bias=args.moe_router_enable_expert_bias,
        bias_update_rate=args.moe_router_bias_update_rate, capacity_factor=args.moe_expert_capacity_factor,
        token_drop_policy=args.moe_token_drop_policy, grouped_gemm=args.moe_grouped_gemm,
        num_groups=args.moe_router_num_groups, group_topk=args.moe_router_group_topk,
    )
