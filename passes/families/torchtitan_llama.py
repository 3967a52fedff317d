"""torchtitan's llama3 model (`torchtitan.models.llama3.Llama3Model`), parallelized unchanged."""

from __future__ import annotations

import torch
from torch import nn

from dtmega.kernels.document_attention import DocumentAttentionCore
from dtmega.passes.families.base import (
    ModelFacts,
    ModelFamily,
    is_class,
    register_family,
)
from dtmega.passes.fusion_sites import norm_sites
from dtmega.passes.rules import Rule


def _matches(model: nn.Module) -> bool:
    return is_class(model, "torchtitan.models", "Decoder") and hasattr(model, "layers") and hasattr(model, "lm_head")


def _describe(model: nn.Module) -> ModelFacts:
    config = model.config
    attention = config.first_attention
    first_block = next(iter(model.layers.values()))
    return ModelFacts(
        family="torchtitan-llama3",
        n_heads=attention.n_heads,
        n_kv_heads=attention.n_kv_heads or attention.n_heads,
        vocab_size=config.vocab_size,
        dim=config.dim,
        ffn_dim=first_block.feed_forward.w1.out_features,
        blocks=tuple(f"layers.{name}" for name in model.layers),
        embedding="tok_embeddings",
        output="lm_head",
        final_norm="norm",
        tied_embeddings=bool(config.enable_weight_tying),
    )


def _logits(model: nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor | None,
            document_ids: torch.Tensor | None = None) -> torch.Tensor:
    if document_ids is not None:  # DocumentMasking's cores (or context-parallel ones) read the ids
        return model(tokens, position_ids, document_ids)
    masks = None
    inner = type(model.config.first_attention.inner_attention).__qualname__
    if inner.startswith(("FlexAttention", "VarlenAttention")):
        positions = position_ids
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape)
        masks = model.get_attention_masks(positions)
    return model(tokens, position_ids, masks)


TORCHTITAN_LLAMA3 = register_family(
    ModelFamily(
        name="torchtitan-llama3",
        matches=_matches,
        describe=_describe,
        tp_rules=(
            Rule("tok_embeddings", "torchtitan_embedding"),
            Rule("layers.*.attention.qkv_linear.w*", "colwise"),
            Rule("layers.*.attention.wo", "rowwise"),
            Rule("layers.*.feed_forward.w1", "colwise"),
            Rule("layers.*.feed_forward.w3", "colwise"),
            Rule("layers.*.feed_forward.w2", "rowwise"),
            Rule("lm_head", "output"),
        ),
        sp_rules=(
            Rule("layers.*.attention_norm", "sequence_norm"),
            Rule("layers.*.ffn_norm", "sequence_norm"),
            Rule("norm", "sequence_norm"),
            Rule("layers.*.attention", "gather_input", options={"args": 3}),
            Rule("layers.*.feed_forward", "gather_input", options={"args": 1}),
        ),
        logits=_logits,
        attention_core="attention.inner_attention",
        position_kwarg="positions",
        document_kwarg="attention_masks",
        document_core=DocumentAttentionCore,
        fusion_sites=norm_sites,
    )
)
