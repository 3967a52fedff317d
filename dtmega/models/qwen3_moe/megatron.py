"""Megatron's flags for Qwen3-MoE: Qwen3's (`--qk-layernorm`, `--kv-channels 128`) with the MoE
flags (`--num-experts`, `--moe-router-topk`, `--moe-ffn-hidden-size`, `--moe-aux-loss-coeff`,
...), as Megatron-LM's and Megatron-Bridge's Qwen3-30B-A3B lines pass them."""

from __future__ import annotations

from typing import Any

from dtmega.models.family import MegatronSizing


def qwen3_moe_flags_config(args: Any, tokenizer_vocab: int):
    """The Qwen3-MoE config Megatron's flags describe (the Llama flags' config: q/k norms on,
    experts from the --moe-* flags)."""
    from dtmega.train.model_flags import model_config

    return model_config(args, tokenizer_vocab)


def _selects(args: Any) -> bool:
    from dtmega.models.gpt.megatron import llama_shaped

    return bool(args.qk_layernorm and args.num_experts and not args.multi_latent_attention and llama_shaped(args))


QWEN3_MOE_FLAGS = MegatronSizing(model="qwen3-moe", selects=_selects, config=qwen3_moe_flags_config,
                                 flag="--qk-layernorm --num-experts")
