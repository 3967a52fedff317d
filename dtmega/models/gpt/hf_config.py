"""Hugging Face `GPT2LMHeadModel` config.json <-> dtmega's GPTConfig.

GPT-2 is Megatron's GPT block: LayerNorm, learned positions, biases everywhere, a 4 x MLP with
GeLU's tanh form (`gelu_new`), the output tied to the word embedding. Reading refuses what
dtmega's GPT does not compute (cross-attention, unscaled or layer-scaled attention, another
activation), naming the field; writing starts from the source model's config when the checkpoint
kept it.
"""

from __future__ import annotations

from typing import Any

from dtmega.models.gpt.config import GPTConfig
from dtmega.models.llama.hf_config import HFFormatError

ARCHITECTURE = "GPT2LMHeadModel"
# transformers' names of GeLU's two forms
_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


def _refuse(source: str, field: str, value: Any, why: str) -> HFFormatError:
    return HFFormatError(f"{source}: {field} = {value!r} is not supported: {why}")


def gpt_config_from_hf(config: dict, source: str = "config.json") -> GPTConfig:
    """The dtmega GPT config of a Hugging Face GPT2LMHeadModel config.json."""
    if (config.get("architectures") or [ARCHITECTURE]) != [ARCHITECTURE]:
        raise _refuse(source, "architectures", config.get("architectures"), f"this reader takes {ARCHITECTURE}")
    activation = config.get("activation_function", "gelu_new")
    if activation not in _GELU:
        raise _refuse(source, "activation_function", activation, f"dtmega's GPT computes {', '.join(_GELU)}")
    if config.get("add_cross_attention"):
        raise _refuse(source, "add_cross_attention", True, "dtmega's GPT is a decoder without cross-attention")
    if not config.get("scale_attn_weights", True):
        raise _refuse(source, "scale_attn_weights", False, "attention scores are scaled by 1/sqrt(head_dim)")
    if config.get("scale_attn_by_inverse_layer_idx"):
        raise _refuse(source, "scale_attn_by_inverse_layer_idx", True, "scores are not scaled per layer")
    dim, layers, heads = int(config.get("n_embd", 768)), int(config.get("n_layer", 12)), int(config.get("n_head", 12))
    for field, value, limit in (("n_layer", layers, 10_000), ("n_embd", dim, 1 << 20), ("n_head", heads, 1 << 16)):
        if value <= 0 or value > limit:  # checked before anything is built from it
            raise _refuse(source, field, value, f"a positive size no larger than {limit}")
    try:
        return GPTConfig(
            dim=dim, n_layers=layers, n_heads=heads, vocab_size=int(config.get("vocab_size", 50257)),
            ffn_dim=int(config.get("n_inner") or 4 * dim), max_seq_len=int(config.get("n_positions", 1024)),
            norm_eps=float(config.get("layer_norm_epsilon", 1e-5)), gelu_approximate=_GELU[activation],
            attention_dropout=float(config.get("attn_pdrop", 0.1)), hidden_dropout=float(config.get("resid_pdrop", 0.1)),
            tie_embeddings=bool(config.get("tie_word_embeddings", True)),
            init_std=float(config.get("initializer_range", 0.02)),
        )
    except ValueError as error:
        raise HFFormatError(f"{source}: {error}") from None


def hf_config_from_gpt(config: GPTConfig, base: dict | None = None, dtype: str = "float32") -> dict:
    """A GPT2LMHeadModel config.json for `config`: `base` (the source model's, when known) with every
    field dtmega owns set from `config`. Refuses a GPT that GPT-2 cannot hold, naming the field."""
    problems = [f"{name}={getattr(config, name)!r} (GPT-2: {want!r})" for name, want in (
        ("normalization", "LayerNorm"), ("layernorm_1p", False), ("position_embedding", "learned_absolute"),
        ("bias", True), ("activation", "gelu"), ("n_kv_heads", config.n_heads), ("kv_channels", None),
        ("qkv_bias", None), ("qk_norm", False)) if getattr(config, name) != want]
    if problems:
        raise HFFormatError(f"{ARCHITECTURE} cannot hold this GPT: {', '.join(problems)}")
    out: dict[str, Any] = dict(base or {}) if (base or {}).get("architectures") in (None, [ARCHITECTURE]) else {}
    out.update({
        "architectures": [ARCHITECTURE], "model_type": "gpt2", "vocab_size": config.vocab_size,
        "n_positions": config.max_seq_len, "n_embd": config.dim, "n_layer": config.n_layers, "n_head": config.n_heads,
        "n_inner": None if config.hidden_ffn == 4 * config.dim else config.hidden_ffn,
        "activation_function": "gelu_new" if config.gelu_approximate == "tanh" else "gelu",
        "layer_norm_epsilon": config.norm_eps, "attn_pdrop": config.attention_dropout,
        "resid_pdrop": config.hidden_dropout, "embd_pdrop": config.hidden_dropout,
        "initializer_range": config.init_std, "tie_word_embeddings": config.tie_embeddings, "dtype": dtype,
    })
    return out
