"""dtmega's Llama sizes as model specs (dtmega.models.registry): `--model llama3-8b` etc."""

from __future__ import annotations

import dataclasses

from dtmega.models.llama.config import NAMED_CONFIGS, LlamaConfig, RopeScaling
from dtmega.models.llama.model import Llama
from dtmega.models.moe_config import MoEConfig
from dtmega.models.registry import ModelSpec


def llama_flops_per_token(config: LlamaConfig, seq_length: int) -> float:
    """Model FLOPs per trained token (forward + backward, recompute not counted): 6 x the
    non-embedding parameters (output layer included) + the attention scores and values,
    12 x layers x heads x head_dim x seq (PaLM's accounting; heads x head_dim = dim unless
    the head width is set apart, as Qwen3's). The input lookup costs no FLOPs; a tied matrix
    still does the output projection. A token passes through its top-k experts only."""
    embedding = config.vocab_size * config.dim
    dense = config.num_active_params() - (0 if config.tie_embeddings else embedding)
    return 6.0 * dense + 12.0 * config.n_layers * config.n_heads * config.head_dim * seq_length


def llama_config_to_dict(config: LlamaConfig) -> dict:
    """LlamaConfig as JSON-ready data."""
    return dataclasses.asdict(config)


def llama_config_from_dict(data: dict) -> LlamaConfig:
    """Inverse of `llama_config_to_dict`."""
    data = dict(data)
    if data.get("rope_scaling") is not None:
        data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
    if data.get("moe") is not None:
        data["moe"] = MoEConfig(**data["moe"])
    return LlamaConfig(**data)


def llama_spec(name: str, config: LlamaConfig, *, family: str = "dtmega-llama", build=Llama,
               size_flags: bool = True, title: str = "dtmega Llama") -> ModelSpec:
    """The spec of one size of dtmega's Llama decoder (Megatron's size flags describe it), or of
    a family built on it (`family`, `build`: Qwen3)."""
    return ModelSpec(
        name=name, family=family, config=config, build=build, flops_per_token=llama_flops_per_token,
        with_vocab=lambda c, vocab: c.replace(vocab_size=vocab), config_to_dict=llama_config_to_dict,
        config_from_dict=llama_config_from_dict, materialize="meta", size_flags=size_flags,
        description=f"{title}, {config.num_params() / 1e9:.3g} B parameters",
    )


# Every named size, and "llama": the name checkpoints written before model specs existed carry
# (and a model sized by Megatron's flags records), any size.
LLAMA_SIZES: tuple[ModelSpec, ...] = (
    *(llama_spec(name, config) for name, config in NAMED_CONFIGS.items()),
    dataclasses.replace(llama_spec("llama", NAMED_CONFIGS["debug"]), description="dtmega Llama (any size)"),
)
