"""Hugging Face `Qwen3ForCausalLM` config.json <-> dtmega's Qwen3 config (a LlamaConfig with q/k norms).

Reading refuses what dtmega's Qwen3 does not compute (sliding-window layers, another activation,
biases), naming the field; writing starts from the source model's config when the checkpoint kept
it, so HF -> dtmega -> HF returns the same config.
"""

from __future__ import annotations

from typing import Any

from dtmega.models.llama.config import LlamaConfig
from dtmega.models.llama.hf_config import HFFormatError, decoder_config_from_hf, hf_config_from_llama

ARCHITECTURE = "Qwen3ForCausalLM"


def qwen3_config_from_hf(config: dict, source: str = "config.json") -> LlamaConfig:
    """The dtmega Qwen3 config of a Hugging Face Qwen3ForCausalLM config.json."""
    if (config.get("architectures") or []) != [ARCHITECTURE]:
        raise HFFormatError(f"{source}: architectures = {config.get('architectures')!r} is not {ARCHITECTURE!r}")
    windowed = [i for i, kind in enumerate(config.get("layer_types") or []) if kind != "full_attention"]
    if config.get("use_sliding_window") or windowed:
        raise HFFormatError(f"{source}: use_sliding_window = {config.get('use_sliding_window')!r}, sliding layers "
                            f"{windowed} are not supported: dtmega's Qwen3 attends fully causally on every layer. "
                            "Fix: a config with use_sliding_window false (every published Qwen3 has it)")
    return decoder_config_from_hf(config, source).replace(qk_norm=True, kv_channels=config.get("head_dim") or None)


def hf_config_from_qwen3(config: LlamaConfig, base: dict | None = None, dtype: str = "float32") -> dict:
    """A Qwen3ForCausalLM `config.json` for `config`: `base` (the source model's, when known) with
    every field dtmega owns set from `config`."""
    if not config.qk_norm or config.moe is not None:
        raise HFFormatError("Qwen3ForCausalLM holds a dense decoder with q/k norms; this config has "
                            f"qk_norm={config.qk_norm}, moe={config.moe is not None}")
    out: dict[str, Any] = dict(base or {}) if (base or {}).get("architectures") in (None, [ARCHITECTURE]) else {}
    fields = hf_config_from_llama(config.replace(qk_norm=False), None, dtype)
    fields.pop("mlp_bias", None)
    out.pop("rope_theta", None)
    out.pop("rope_scaling", None)
    out.update(fields)
    out.update({"architectures": [ARCHITECTURE], "model_type": "qwen3", "head_dim": config.head_dim,
                "use_sliding_window": False, "sliding_window": None, "max_window_layers": config.n_layers,
                "layer_types": ["full_attention"] * config.n_layers, "attention_bias": False})
    return out
