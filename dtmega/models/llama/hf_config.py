"""Hugging Face `config.json` <-> dtmega's LlamaConfig, for the Llama family and Mixtral.

Reading checks every field that changes the computation and that dtmega's Llama does not
have (biases, another activation, sliding windows, another RoPE type): such a config is
refused with the field named, never loaded into a model that would compute something else.
Writing starts from the source model's own config when the checkpoint kept it (so HF -> dtmega
-> HF returns the same config) and sets every field dtmega owns.
"""

from __future__ import annotations

from typing import Any

from dtmega.kernels.errors import DtmegaError
from dtmega.models.llama.config import LlamaConfig, RopeScaling
from dtmega.models.moe_config import MoEConfig

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral"}


class HFFormatError(DtmegaError):
    """A Hugging Face checkpoint dtmega cannot read as asked; the message names the file, the
    field and the fix."""


def _unsupported(source: str, field: str, value: Any, why: str) -> HFFormatError:
    return HFFormatError(f"{source}: {field} = {value!r} is not supported: {why}")


def _rope(config: dict, source: str) -> tuple[float, RopeScaling | None]:
    """(theta, Llama-3.1 scaling or None) from transformers 5's `rope_parameters` or the older
    top-level `rope_theta` + `rope_scaling`."""
    params = dict(config.get("rope_parameters") or {})
    field = "rope_parameters"
    if not params:
        params = dict(config.get("rope_scaling") or {})
        field = "rope_scaling"
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, RopeScaling(
            factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_seq_len=int(params["original_max_position_embeddings"]),
        )
    raise _unsupported(source, f"{field}.rope_type", kind,
                       "dtmega's RoPE is the default or Llama-3.1's ('llama3') frequency scaling")


def llama_config_from_hf(config: dict, source: str = "config.json") -> LlamaConfig:
    """The LlamaConfig of a Hugging Face `LlamaForCausalLM` or `MixtralForCausalLM` config."""
    architectures = config.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        raise _unsupported(source, "architectures", architectures,
                           f"dtmega reads {' and '.join(ARCHITECTURES)}. Fix: convert a model of those architectures")
    moe = None
    if architectures[0] == "MixtralForCausalLM":
        moe = MoEConfig(num_experts=int(config["num_local_experts"]), top_k=int(config["num_experts_per_tok"]),
                        ffn_dim=config["intermediate_size"],
                        aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.01)))
    return decoder_config_from_hf(config, source).replace(moe=moe)


def decoder_config_from_hf(config: dict, source: str = "config.json") -> LlamaConfig:
    """The LlamaConfig of the fields every Llama-like Hugging Face decoder shares (sizes, norm,
    RoPE, tying), each field that would change the computation checked; the caller checks the
    architecture and adds what is its own (Mixtral's experts, Qwen3's q/k norms)."""
    for field, fine in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(field, fine) != fine:
            raise _unsupported(source, field, config[field], f"dtmega's Llama has {field} = {fine!r}")
    if config.get("sliding_window") is not None and config.get("use_sliding_window", True):
        raise _unsupported(source, "sliding_window", config["sliding_window"],
                           "dtmega's attention is full causal. Fix: a config with sliding_window null")
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(config.get(field), int) or isinstance(config.get(field), bool):
            raise HFFormatError(f"{source}: {field} is missing or not an integer ({config.get(field)!r})")
        if config[field] <= 0:
            raise HFFormatError(f"{source}: {field} must be positive, got {config[field]}")
    for field in ("rms_norm_eps", "initializer_range", "rope_theta", "max_position_embeddings", "head_dim",
                  "num_key_value_heads"):
        value = config.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise HFFormatError(f"{source}: {field} = {value!r} is not a number. Fix: the model's own config.json")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    theta, scaling = _rope(config, source)
    try:
        return LlamaConfig(
            dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads") or heads, vocab_size=config["vocab_size"],
            ffn_dim=config["intermediate_size"], norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling, max_seq_len=int(config.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            init_std=float(config.get("initializer_range", 0.02)),
            kv_channels=None if head_dim * heads == config["hidden_size"] else head_dim,
        )
    except (ValueError, DtmegaError) as error:
        raise HFFormatError(f"{source}: {error}") from None


def hf_config_from_llama(config: LlamaConfig, base: dict | None = None, dtype: str = "float32") -> dict:
    """A `config.json` for `config`: `base` (the source model's config, when known) with every
    field dtmega owns set from `config`; transformers 5's `rope_parameters` form."""
    if config.qk_norm:
        raise HFFormatError("this Llama normalizes queries and keys per head (qk_norm), which LlamaForCausalLM has no "
                            "weights for; Hugging Face's Qwen3ForCausalLM has them (dtmega's Qwen3 family, "
                            "dtmega.models.qwen3, writes it)")
    moe = config.moe
    if moe is not None and (moe.shared_expert_ffn_dim or moe.first_dense_layers or moe.layer_freq != 1
                            or moe.score_func != "softmax" or moe.expert_bias or moe.ffn_dim != config.ffn_dim):
        raise HFFormatError(
            "this MoE model has no Hugging Face Mixtral equivalent (Mixtral: every block MoE, softmax router, "
            "no shared expert or expert bias, expert width = intermediate_size)"
        )
    out = dict(base or {})
    architecture = "MixtralForCausalLM" if moe is not None else "LlamaForCausalLM"
    if out.get("architectures") not in (None, [architecture]):
        out = {}  # the base describes another model: start clean
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope = {"rope_theta": config.rope_theta, "rope_type": "llama3", "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_seq_len}
    out.pop("rope_theta", None)
    out.pop("rope_scaling", None)
    out.update({
        "architectures": [architecture], "model_type": "mixtral" if moe is not None else "llama",
        "hidden_size": config.dim, "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads, "intermediate_size": config.ffn_dim,
        "vocab_size": config.vocab_size, "rms_norm_eps": config.norm_eps, "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu", "rope_parameters": rope, "dtype": dtype,
    })
    if out.get("head_dim", 0) is not None:  # an explicit null (derived from the width) stays null
        out["head_dim"] = config.head_dim
    if moe is None:
        out.update({"attention_bias": out.get("attention_bias", False), "mlp_bias": out.get("mlp_bias", False)})
    else:
        out.update({"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                    "router_aux_loss_coef": moe.aux_loss_coeff, "sliding_window": None})
    if "torch_dtype" in out:  # transformers 4's name for the weights' dtype
        out["torch_dtype"] = dtype
    out.setdefault("initializer_range", config.init_std)
    return out
