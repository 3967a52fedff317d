"""dtmega's DeepSeek sizes as model specs (dtmega.models.registry): `--model deepseek-v3` etc."""

from __future__ import annotations

import dataclasses

from dtmega.models.deepseek.config import NAMED_CONFIGS, DeepSeekConfig, YarnScaling
from dtmega.models.deepseek.model import DeepSeek
from dtmega.models.moe_config import MoEConfig
from dtmega.models.registry import ModelSpec


def deepseek_flops_per_token(config: DeepSeekConfig, seq_length: int) -> float:
    """Model FLOPs per trained token: 6 x the parameters a token passes through (its top-k
    experts; not the input lookup) + MLA's scores and values, 6 x layers x seq x heads x
    (qk_head_dim + v_head_dim) (the Llama's 12 x layers x dim x seq when both head dims are
    dim / heads); each multi-token-prediction depth adds its block, its projection and the
    shared output layer's GEMM once more."""
    embedding = config.vocab_size * config.dim
    dense = config.num_active_params() - (0 if config.tie_embeddings else embedding)
    per_block_attention = 6.0 * seq_length * config.n_heads * (config.qk_head_dim + config.v_head_dim)
    # each MTP depth: one more block, its 2D -> D projection and the shared output layer again
    mtp = config.num_active_params(with_mtp=True) - config.num_active_params() + embedding
    return 6.0 * dense + config.n_layers * per_block_attention + config.mtp_num_layers * per_block_attention + \
        (6.0 * mtp if config.mtp_num_layers else 0.0)


def deepseek_config_to_dict(config: DeepSeekConfig) -> dict:
    """DeepSeekConfig as JSON-ready data."""
    return dataclasses.asdict(config)


def deepseek_config_from_dict(data: dict) -> DeepSeekConfig:
    """Inverse of `deepseek_config_to_dict`."""
    data = dict(data)
    if data.get("yarn") is not None:
        data["yarn"] = YarnScaling(**data["yarn"])
    if data.get("moe") is not None:
        data["moe"] = MoEConfig(**data["moe"])
    return DeepSeekConfig(**data)


def deepseek_spec(name: str, config: DeepSeekConfig) -> ModelSpec:
    """The spec of one DeepSeek size."""
    return ModelSpec(
        name=name, family="dtmega-deepseek", config=config, build=DeepSeek, flops_per_token=deepseek_flops_per_token,
        with_vocab=lambda c, vocab: c.replace(vocab_size=vocab), config_to_dict=deepseek_config_to_dict,
        config_from_dict=deepseek_config_from_dict, materialize="meta", size_flags=False,
        description=f"dtmega DeepSeek-V3 family, {config.num_params() / 1e9:.3g} B parameters "
                    f"({config.num_activated_params() / 1e9:.3g} B activated)",
    )


DEEPSEEK_SIZES: tuple[ModelSpec, ...] = tuple(deepseek_spec(name, config) for name, config in NAMED_CONFIGS.items())
