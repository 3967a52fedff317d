"""Megatron's model flags as dtmega's Llama: --num-layers, --hidden-size, --num-attention-heads,
--group-query-attention/--num-query-groups, --ffn-hidden-size, --kv-channels (a head width of
its own), the MoE flags (dtmega/train/model_flags.py `model_config` reads them). The family every
Megatron GPT line with --swiglu --normalization RMSNorm --position-embedding-type rope builds
unless another family's flags select it (--qk-layernorm: Qwen3; --multi-latent-attention:
DeepSeek)."""

from __future__ import annotations

from typing import Any

from dtmega.models.family import MegatronSizing


def llama_flags_config(args: Any, tokenizer_vocab: int):
    """The LlamaConfig Megatron's flags describe, with the tokenizer's padded vocabulary."""
    from dtmega.train.model_flags import model_config

    return model_config(args, tokenizer_vocab)


LLAMA_FLAGS = MegatronSizing(model="llama", selects=lambda args: True, config=llama_flags_config)
