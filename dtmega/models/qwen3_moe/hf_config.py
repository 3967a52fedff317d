"""Hugging Face `Qwen3MoeForCausalLM` config.json <-> dtmega's Qwen3-MoE config (a LlamaConfig
with q/k norms and experts).

Reading refuses what dtmega's Qwen3-MoE does not compute (sliding-window layers, another
activation, biases, a pattern of MoE blocks dtmega's `first_dense_layers`/`layer_freq` cannot
say), naming the field; writing starts from the source model's config when the checkpoint kept
it, so HF -> dtmega -> HF returns the same config.
"""

from __future__ import annotations

from dtmega.models.llama.config import LlamaConfig
from dtmega.models.llama.hf_config import HFFormatError
from dtmega.models.moe_config import MoEConfig
from dtmega.models.qwen3.hf_config import hf_config_from_qwen3, qwen3_config_from_hf

ARCHITECTURE = "Qwen3MoeForCausalLM"


def _integer(config: dict, source: str, *fields: str) -> int:
    """The first of `fields` present, a positive integer (transformers 5 writes num_experts as
    num_local_experts; the published configs say num_experts)."""
    for field in fields:
        value = config.get(field)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise HFFormatError(f"{source}: {field} = {value!r} must be a positive integer. Fix: the model's own "
                                    "config.json")
            return value
    raise HFFormatError(f"{source}: {' or '.join(fields)} is missing: a Qwen3MoeForCausalLM config names it")


def hf_moe_layers(config: dict, layers: int) -> list[bool]:
    """Which blocks Qwen3MoeForCausalLM makes MoE: not in `mlp_only_layers`, and (i + 1) a
    multiple of `decoder_sparse_step`."""
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def _pattern(moe_layers: list[bool], source: str) -> tuple[int, int]:
    """dtmega's (first_dense_layers, layer_freq) for the MoE pattern, or refused naming it."""
    chosen = [i for i, moe in enumerate(moe_layers) if moe]
    if not chosen:
        raise HFFormatError(f"{source}: no block is MoE (mlp_only_layers / decoder_sparse_step): this is a dense "
                            "Qwen3. Fix: a Qwen3ForCausalLM config")
    first = chosen[0]
    freq = chosen[1] - chosen[0] if len(chosen) > 1 else max(1, len(moe_layers) - first)
    if [i >= first and (i - first) % freq == 0 for i in range(len(moe_layers))] != moe_layers:
        raise HFFormatError(f"{source}: MoE blocks {chosen} (mlp_only_layers, decoder_sparse_step) are not dtmega's "
                            "pattern: the first blocks dense, then every k-th block MoE (Megatron's --moe-layer-freq). "
                            "Fix: a config whose MoE blocks follow that pattern (every published Qwen3-MoE's do)")
    return first, freq


def qwen3_moe_config_from_hf(config: dict, source: str = "config.json") -> LlamaConfig:
    """The dtmega Qwen3-MoE config of a Hugging Face Qwen3MoeForCausalLM config.json."""
    if (config.get("architectures") or []) != [ARCHITECTURE]:
        raise HFFormatError(f"{source}: architectures = {config.get('architectures')!r} is not {ARCHITECTURE!r}")
    experts = _integer(config, source, "num_experts", "num_local_experts")
    top_k = _integer(config, source, "num_experts_per_tok")
    expert_dim = _integer(config, source, "moe_intermediate_size")
    layers = _integer(config, source, "num_hidden_layers")
    first, freq = _pattern(hf_moe_layers(config, layers), source)
    coefficient = config.get("router_aux_loss_coef", 1e-3)
    if isinstance(coefficient, bool) or not isinstance(coefficient, (int, float)) or not coefficient >= 0:
        raise HFFormatError(f"{source}: router_aux_loss_coef = {coefficient!r} must be a number >= 0")
    try:
        moe = MoEConfig(num_experts=experts, top_k=top_k, ffn_dim=expert_dim, first_dense_layers=first,
                        layer_freq=freq, score_func="softmax", pre_softmax=not config.get("norm_topk_prob", False),
                        load_balancing="aux_loss", aux_loss_coeff=float(coefficient))
    except ValueError as error:
        raise HFFormatError(f"{source}: {error}") from None
    dense = dict(config, architectures=["Qwen3ForCausalLM"])
    return qwen3_config_from_hf(dense, source).replace(moe=moe)


def hf_config_from_qwen3_moe(config: LlamaConfig, base: dict | None = None, dtype: str = "float32") -> dict:
    """A Qwen3MoeForCausalLM `config.json` for `config`: `base` (the source model's, when known)
    with every field dtmega owns set from `config`."""
    moe = config.moe
    if not config.qk_norm or moe is None:
        raise HFFormatError("Qwen3MoeForCausalLM holds a decoder with q/k norms and experts; this config has "
                            f"qk_norm={config.qk_norm}, moe={moe is not None}")
    if (moe.shared_expert_ffn_dim or moe.score_func != "softmax" or moe.expert_bias or moe.activation != "swiglu"
            or moe.capacity_factor is not None or moe.num_groups is not None):
        raise HFFormatError("this MoE has no Qwen3MoeForCausalLM equivalent (Qwen3-MoE: softmax top-k over SwiGLU "
                            "experts, dropless, no shared expert, expert bias or group-limited routing)")
    own = dict(base or {}) if (base or {}).get("architectures") in (None, [ARCHITECTURE]) else {}
    out = hf_config_from_qwen3(config.replace(moe=None), {**own, "architectures": ["Qwen3ForCausalLM"]}, dtype)
    moe_layers = [moe.is_moe_layer(i) for i in range(config.n_layers)]
    if hf_moe_layers(own, config.n_layers) != moe_layers:  # the base's own fields say it otherwise
        out.update({"decoder_sparse_step": 1, "mlp_only_layers": [i for i, m in enumerate(moe_layers) if not m]})
    out.setdefault("decoder_sparse_step", 1)
    out.setdefault("mlp_only_layers", [])
    experts_field = "num_local_experts" if "num_local_experts" in own and "num_experts" not in own else "num_experts"
    out.update({"architectures": [ARCHITECTURE], "model_type": "qwen3_moe", experts_field: moe.num_experts,
                "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.ffn_dim,
                "norm_topk_prob": not moe.pre_softmax, "router_aux_loss_coef": moe.aux_loss_coeff})
    out.setdefault("output_router_logits", False)
    return out
