"""Hugging Face `transformers.LlamaForCausalLM`, parallelized unchanged."""

from __future__ import annotations

import torch
from torch import nn

from dtmega.passes.families.base import (
    ModelFacts,
    ModelFamily,
    is_class,
    register_family,
)
from dtmega.passes.fusion_sites import norm_sites
from dtmega.passes.rules import Rule


def _matches(model: nn.Module) -> bool:
    return is_class(model, "transformers", "LlamaForCausalLM")


def describe_hf_decoder(model: nn.Module) -> ModelFacts:
    """Shape facts of a Hugging Face Llama-style decoder (`model.layers`, `lm_head`)."""
    config = model.config
    return ModelFacts(
        family="hf-llama",
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        vocab_size=config.vocab_size,
        dim=config.hidden_size,
        ffn_dim=config.intermediate_size,
        blocks=tuple(f"model.layers.{i}" for i in range(len(model.model.layers))),
        embedding="model.embed_tokens",
        output="lm_head",
        final_norm="model.norm",
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_positions=getattr(config, "max_position_embeddings", None),
    )


def _logits(model: nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    return model(input_ids=tokens, position_ids=position_ids, use_cache=False).logits


HF_LLAMA = register_family(
    ModelFamily(
        name="hf-llama",
        matches=_matches,
        describe=describe_hf_decoder,
        tp_rules=(
            Rule("model.embed_tokens", "embedding"),
            Rule("model.layers.*.self_attn.q_proj", "colwise"),
            Rule("model.layers.*.self_attn.k_proj", "colwise"),
            Rule("model.layers.*.self_attn.v_proj", "colwise"),
            Rule("model.layers.*.self_attn.o_proj", "rowwise"),
            Rule("model.layers.*.mlp.gate_proj", "colwise"),
            Rule("model.layers.*.mlp.up_proj", "colwise"),
            Rule("model.layers.*.mlp.down_proj", "rowwise"),
            Rule("lm_head", "output"),
        ),
        sp_rules=(
            Rule("model.layers.*.input_layernorm", "sequence_norm"),
            Rule("model.layers.*.post_attention_layernorm", "sequence_norm"),
            Rule("model.norm", "sequence_norm"),
            Rule("model.layers.*.self_attn", "gather_input", options={"kwarg": "hidden_states"}),
            Rule("model.layers.*.mlp", "gather_input", options={"args": 1}),
        ),
        logits=_logits,
        documents_by_positions=True,
        fusion_sites=norm_sites,
    )
)
