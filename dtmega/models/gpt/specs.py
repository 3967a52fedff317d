"""The GPT family's named sizes as model specs (`--model gpt2-124m` etc.) and its FLOPs."""

from __future__ import annotations

import dataclasses

from dtmega.models.gpt.config import GPT_SIZES, GPTConfig
from dtmega.models.gpt.model import GPT
from dtmega.models.moe_config import MoEConfig
from dtmega.models.registry import ModelSpec


def gpt_flops_per_token(config: GPTConfig, seq_length: int) -> float:
    """Model FLOPs per trained token (forward + backward): 6 x the parameters a token's GEMMs use
    (the blocks and the output layer; the word and position lookups cost none) + the attention
    scores and values, 12 x layers x heads x head_dim x seq (PaLM's accounting, as the Llama's)."""
    lookups = config.vocab_size * config.dim * (0 if config.tie_embeddings else 1)
    if config.position_embedding == "learned_absolute":
        lookups += config.max_seq_len * config.dim
    dense = config.num_active_params() - lookups  # a token passes through its top-k experts only
    return 6.0 * dense + 12.0 * config.n_layers * config.n_heads * config.head_dim * seq_length


def gpt_config_from_dict(data: dict) -> GPTConfig:
    """Inverse of dataclasses.asdict for GPTConfig."""
    data = dict(data)
    if data.get("moe") is not None:
        data["moe"] = MoEConfig(**data["moe"])
    return GPTConfig(**data)


def gpt_spec(name: str, config: GPTConfig) -> ModelSpec:
    """The spec of one GPT size (Megatron's size flags build a GPT recorded as "gpt")."""
    return ModelSpec(
        name=name, family="dtmega-gpt", config=config, build=GPT, flops_per_token=gpt_flops_per_token,
        with_vocab=lambda c, vocab: c.replace(vocab_size=vocab), config_to_dict=dataclasses.asdict,
        config_from_dict=gpt_config_from_dict, materialize="meta", size_flags=False,
        description=f"GPT (Megatron's GPT blocks), {config.num_params() / 1e9:.3g} B parameters",
    )


GPT_SPECS: tuple[ModelSpec, ...] = (
    *(gpt_spec(name, config) for name, config in GPT_SIZES.items()),
    dataclasses.replace(gpt_spec("gpt", GPT_SIZES["gpt-debug"]), description="GPT (any size)"),
)
