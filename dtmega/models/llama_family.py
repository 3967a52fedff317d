"""dtmega's own Llama as a model family: its rule sets and shape facts."""

from __future__ import annotations

import torch
from torch import nn

from dtmega.models.llama import Llama
from dtmega.passes.families import ModelFacts, ModelFamily, register_family
from dtmega.passes.rules import Rule


def _describe(model: Llama) -> ModelFacts:
    c = model.config
    return ModelFacts(
        family="dtmega-llama",
        n_heads=c.n_heads,
        n_kv_heads=c.n_kv_heads,
        vocab_size=c.vocab_size,
        dim=c.dim,
        ffn_dim=c.ffn_dim,
        blocks=tuple(f"layers.{name}" for name in model.layers),
        embedding="tok_embeddings",
        output="output",
        final_norm="norm",
        tied_embeddings=c.tie_embeddings,
    )


def _logits(model: nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    return model(tokens, position_ids)


DTMEGA_LLAMA = register_family(
    ModelFamily(
        name="dtmega-llama",
        matches=lambda model: isinstance(model, Llama),
        describe=_describe,
        tp_rules=(
            Rule("tok_embeddings", "embedding"),
            Rule("layers.*.attention.wq", "colwise"),
            Rule("layers.*.attention.wk", "colwise"),
            Rule("layers.*.attention.wv", "colwise"),
            Rule("layers.*.attention.wo", "rowwise"),
            Rule("layers.*.feed_forward.w1", "colwise"),
            Rule("layers.*.feed_forward.w3", "colwise"),
            Rule("layers.*.feed_forward.w2", "rowwise"),
            Rule("output", "output"),
        ),
        sp_rules=(
            Rule("layers.*.attention_norm", "sequence_norm"),
            Rule("layers.*.ffn_norm", "sequence_norm"),
            Rule("norm", "sequence_norm"),
            Rule("layers.*.attention", "gather_input", options={"args": 2}),
            Rule("layers.*.feed_forward", "gather_input", options={"args": 1}),
        ),
        logits=_logits,
        attention_core="attention.core",
    )
)
