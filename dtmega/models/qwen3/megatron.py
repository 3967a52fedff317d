"""Megatron's flags for Qwen3: its Llama flags (dtmega/models/llama/megatron.py) with
`--qk-layernorm` (per-head RMSNorm on queries and keys, which selects this family) and usually
`--kv-channels 128` (the head width, independent of --hidden-size / --num-attention-heads), as
Megatron-LM's Qwen3 launch scripts pass them."""

from __future__ import annotations

from typing import Any

from dtmega.models.family import MegatronSizing


def qwen3_flags_config(args: Any, tokenizer_vocab: int):
    """The Qwen3 config Megatron's flags describe (the Llama flags' config, q/k norms on)."""
    from dtmega.train.model_flags import model_config

    return model_config(args, tokenizer_vocab)


def _selects(args: Any) -> bool:
    from dtmega.models.gpt.megatron import llama_shaped

    # --qk-layernorm on a Llama block; on GPT blocks (LayerNorm, biases, dropout...) it is the GPT family's
    return bool(args.qk_layernorm and not args.multi_latent_attention and llama_shaped(args))


QWEN3_FLAGS = MegatronSizing(model="qwen3", selects=_selects,
                             config=qwen3_flags_config, flag="--qk-layernorm")
