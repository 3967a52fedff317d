"""A model family of one's own, registered from a folder outside the package: its model
(model.py) and, here, what the compiler and the trainer need to know of it, in one `Family`
registered once: the passes' family (facts, tensor- and sequence-parallel rules) and the named
model the trainer and `dtmega plan` build (docs/adding-a-model.md)."""

from __future__ import annotations

import torch
from torch import nn

from dtmega.models import Family, ModelSpec, register_model_family
from dtmega.passes import ModelFacts, ModelFamily, Rule
from tests.families.tiny_gpt.model import TinyGPT, TinyGPTConfig


def describe(model: TinyGPT) -> ModelFacts:
    c = model.config
    return ModelFacts(family="tiny-gpt", n_heads=c.heads, n_kv_heads=c.heads, vocab_size=c.vocab, dim=c.dim,
                      ffn_dim=c.ffn, blocks=tuple(f"blocks.{i}" for i in range(c.layers)), embedding="embed",
                      output="head", final_norm="ln_f", max_positions=c.max_len)


def logits(model: nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    return model(tokens)  # no position encoding: positions are only the causal order


PASSES = ModelFamily(
    name="tiny-gpt",
    matches=lambda model: type(model).__name__ == "TinyGPT",
    describe=describe,
    tp_rules=(Rule("embed", "embedding"), Rule("blocks.*.attn.q", "colwise"), Rule("blocks.*.attn.k", "colwise"),
              Rule("blocks.*.attn.v", "colwise"), Rule("blocks.*.attn.o", "rowwise"),
              Rule("blocks.*.mlp.gate", "colwise"), Rule("blocks.*.mlp.up", "colwise"),
              Rule("blocks.*.mlp.down", "rowwise"), Rule("head", "output")),
    sp_rules=(Rule("blocks.*.ln_attn", "sequence_norm"), Rule("blocks.*.ln_mlp", "sequence_norm"),
              Rule("ln_f", "sequence_norm"), Rule("blocks.*.attn", "gather_input", options={"args": 1}),
              Rule("blocks.*.mlp", "gather_input", options={"args": 1})),
    logits=logits,
)


def flops_per_token(config: TinyGPTConfig, seq: int) -> float:
    """6 x the non-embedding parameters + 12 x layers x width x sequence."""
    per_block = 4 * config.dim * config.dim + 3 * config.dim * config.ffn
    return 6.0 * (config.layers * per_block + config.vocab * config.dim) + 12.0 * config.layers * config.dim * seq


TINY_GPT = ModelSpec(
    name="tiny-gpt", family="tiny-gpt", config=TinyGPTConfig(), build=TinyGPT, flops_per_token=flops_per_token,
    with_vocab=lambda config, vocab: TinyGPTConfig(**{**config.to_dict(), "vocab": vocab}),
    config_to_dict=TinyGPTConfig.to_dict, config_from_dict=lambda data: TinyGPTConfig(**data),
    materialize="seeded",
)

register_model_family(Family(name="tiny-gpt", passes=PASSES, sizes=(TINY_GPT,)))
