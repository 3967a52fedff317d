"""Megatron's flags as the GPT family: what `pretrain_gpt.py` builds from them, with Megatron's
defaults where a flag is absent (LayerNorm, learned absolute positions, biases, a GeLU MLP of
4 x hidden, dropout 0.1, the output tied to the embedding).

A line selects this family unless its flags describe exactly dtmega's Llama (--swiglu
--normalization RMSNorm --position-embedding-type rope --disable-bias-linear, no dropout, no
--add-qkv-bias or --apply-layernorm-1p) or another family's attention (--multi-latent-attention:
DeepSeek); --qk-layernorm on a Llama block is Qwen3, on GPT blocks their q/k norms (`qk_norm`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from dtmega.models.family import MegatronSizing


def llama_shaped(args: Any) -> bool:
    """Whether Megatron's flags describe a Llama block (what dtmega's Llama computes exactly)."""
    return (args.swiglu and args.normalization == "RMSNorm" and args.position_embedding_type == "rope"
            and args.disable_bias_linear and not args.add_qkv_bias and not args.apply_layernorm_1p
            and not args.squared_relu and not args.attention_dropout and not args.hidden_dropout
            and args.rotary_percent == 1.0)


def gpt_features(args: Any) -> list[str]:
    """The GPT-block features of a line that are not Llama's, as flags (for messages)."""
    found = []
    if not args.swiglu:
        found.append("--squared-relu" if args.squared_relu else "a GeLU MLP (no --swiglu)")
    if args.normalization != "RMSNorm":
        found.append(f"--normalization {args.normalization}")
    if args.apply_layernorm_1p:
        found.append("--apply-layernorm-1p")
    if args.position_embedding_type != "rope":
        found.append(f"--position-embedding-type {args.position_embedding_type}")
    if not args.disable_bias_linear:
        found.append("biases (no --disable-bias-linear)")
    if args.add_qkv_bias:
        found.append("--add-qkv-bias")
    if args.rotary_percent != 1.0:
        found.append(f"--rotary-percent {args.rotary_percent}")
    if args.attention_dropout or args.hidden_dropout:
        found.append(f"dropout (--attention-dropout {args.attention_dropout} --hidden-dropout {args.hidden_dropout})")
    return found


def gpt_flags_config(args: Any, tokenizer_vocab: int):
    """The GPTConfig Megatron's flags describe, with the tokenizer's padded vocabulary."""
    from dtmega.models.gpt.config import GPTConfig
    from dtmega.train.arg_fields import ArgumentError
    from dtmega.train.model_flags import check_heads, moe_config, padded_vocab

    required = {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
                "num_attention_heads": args.num_attention_heads}
    missing = [f"--{k.replace('_', '-')}" for k, v in required.items() if v is None]
    if missing:
        raise ArgumentError(f"the model needs {', '.join(missing)} (or a preset: --model gpt2-124m)")
    if args.num_experts and not args.disable_bias_linear:
        raise ArgumentError("--num-experts with biases (no --disable-bias-linear): experts with biases are not built "
                            "yet (dtmega's grouped experts carry none). Fix: add --disable-bias-linear, as every "
                            "Megatron MoE recipe and functional test passes it")
    heads = args.num_attention_heads
    kv_heads = args.num_query_groups if args.group_query_attention else heads
    if args.group_query_attention and not args.num_query_groups:
        raise ArgumentError("--group-query-attention needs --num-query-groups")
    head_dim = args.kv_channels
    if head_dim is not None and head_dim * heads == args.hidden_size:
        head_dim = None
    check_heads(args.hidden_size, heads, kv_heads, args.group_query_attention, explicit_head_dim=head_dim is not None)
    positions = args.max_position_embeddings or args.seq_length
    if args.seq_length > positions:
        raise ArgumentError(f"--seq-length {args.seq_length} is longer than --max-position-embeddings {positions} (the "
                            f"position table). Fix: --max-position-embeddings {args.seq_length} or more")
    ffn = args.ffn_hidden_size
    if ffn is None:  # Megatron: 4 x hidden; with --swiglu, 8/3 x hidden rounded to 64 (dtmega's Llama rule)
        ffn = int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu else 4 * args.hidden_size
    activation = "swiglu" if args.swiglu else "squared_relu" if args.squared_relu else "gelu"
    # Megatron's fused bias-GeLU is the tanh form; without biases it turns the fusion off (F.gelu, erf)
    gelu_form = "none" if args.no_bias_gelu_fusion or args.disable_bias_linear else "tanh"
    moe = moe_config(args, ffn)
    if moe is not None:  # the experts are the block's MLP kind (Megatron's activation_func), no biases
        moe = dataclasses.replace(moe, activation=activation, gelu_approximate=gelu_form)
    try:
        return GPTConfig(
            dim=args.hidden_size, n_layers=args.num_layers, n_heads=heads,
            n_kv_heads=kv_heads, vocab_size=padded_vocab(tokenizer_vocab, args),
            ffn_dim=ffn, max_seq_len=positions, normalization=args.normalization,
            layernorm_1p=args.apply_layernorm_1p, norm_eps=args.norm_epsilon,
            position_embedding=args.position_embedding_type, rope_theta=args.rotary_base,
            bias=not args.disable_bias_linear, qkv_bias=True if args.add_qkv_bias else None, activation=activation,
            gelu_approximate=gelu_form,
            attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
            tie_embeddings=not args.untie_embeddings_and_output_weights, init_std=args.init_method_std,
            kv_channels=head_dim, moe=moe, qk_norm=args.qk_layernorm, rotary_percent=args.rotary_percent,
        )
    except ValueError as error:
        raise ArgumentError(str(error)) from None


GPT_FLAGS = MegatronSizing(
    model="gpt", config=gpt_flags_config,
    selects=lambda args: not llama_shaped(args) and not args.multi_latent_attention,
)
