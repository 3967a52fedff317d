"""Where each dtmega DeepSeek weight lives in a Hugging Face `DeepseekV3ForCausalLM` state, and
back: whole tensors (conversion, export, tests).

Routed experts come either as DeepSeek's checkpoint files hold them (one `gate_proj`, `up_proj`,
`down_proj` per expert) or as transformers holds them in memory (`gate_up_proj` [E, 2I, D] and
`down_proj` [E, D, I]); both are read, the per-expert form is written. The router's
`e_score_correction_bias` is dtmega's `expert_bias`.

RoPE: dtmega rotates adjacent channel pairs, as DeepSeek's checkpoints lay out the rotary
channels (transformers' `rope_interleave=True`). A config with `rope_interleave=False` rotates
channel i with i + d/2; its rotary rows are permuted into pairs on the way in (the query's
rotary rows of every head, and the shared rotary key's rows), and back on the way out.
"""

from __future__ import annotations

import re

import torch

from dtmega.models.deepseek.config import DeepSeekConfig
from dtmega.models.llama.hf_names import dtmega_rows_to_hf, hf_rows_to_dtmega

_ATTENTION = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
              "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_DENSE = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def _rope_rows(weight: torch.Tensor, config: DeepSeekConfig, name: str, to_dtmega: bool) -> torch.Tensor:
    """Permutes the rotary rows of a query or latent-key projection between HF's half-split and
    dtmega's paired layout."""
    move = hf_rows_to_dtmega if to_dtmega else dtmega_rows_to_hf
    rope = config.qk_rope_head_dim
    if name in ("wq", "wq_b"):
        heads = weight.view(config.n_heads, config.qk_head_dim, -1)
        rotary = move(heads[:, config.qk_nope_head_dim:].reshape(config.n_heads * rope, -1), config.n_heads)
        heads = torch.cat([heads[:, :config.qk_nope_head_dim], rotary.view(config.n_heads, rope, -1)], dim=1)
        return heads.reshape(weight.shape)
    return torch.cat([weight[:config.kv_lora_rank], move(weight[config.kv_lora_rank:], 1)])


def dtmega_state_from_hf(hf: dict[str, torch.Tensor], config: DeepSeekConfig,
                         rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """dtmega's state dict (tensors as given: views where possible) from an HF state dict."""
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in _TOP.items():
        if ours == "output.weight" and config.tie_embeddings:
            continue
        out[ours] = hf[theirs]
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attention_norm.weight"] = hf[p + "input_layernorm.weight"]
        out[f"layers.{i}.ffn_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
        for ours, theirs in _ATTENTION.items():
            key = f"{p}self_attn.{theirs}.weight"
            if key in hf:
                weight = hf[key]
                if not rope_interleave and ours in ("wq", "wq_b", "wkv_a"):
                    weight = _rope_rows(weight, config, ours, to_dtmega=True)
                out[f"layers.{i}.attention.{ours}.weight"] = weight
        f = f"layers.{i}.feed_forward."
        if config.moe is None or not config.moe.is_moe_layer(i):
            for ours, theirs in _DENSE.items():
                out[f"{f}{ours}.weight"] = hf[f"{p}mlp.{theirs}.weight"]
            continue
        out[f"{f}router.gate.weight"] = hf[f"{p}mlp.gate.weight"]
        out[f"{f}router.expert_bias"] = hf[f"{p}mlp.gate.e_score_correction_bias"]
        for ours, theirs in _DENSE.items():
            if config.moe.shared_expert_ffn_dim:
                out[f"{f}shared_experts.{ours}.weight"] = hf[f"{p}mlp.shared_experts.{theirs}.weight"]
        if f"{p}mlp.experts.gate_up_proj" in hf:  # transformers' in-memory layout
            gate_up = hf[f"{p}mlp.experts.gate_up_proj"]
            out[f"{f}experts.w1"], out[f"{f}experts.w3"] = gate_up.chunk(2, dim=1)
            out[f"{f}experts.w2"] = hf[f"{p}mlp.experts.down_proj"]
        else:
            for ours, theirs in _DENSE.items():
                out[f"{f}experts.{ours}"] = torch.stack([hf[f"{p}mlp.experts.{e}.{theirs}.weight"]
                                                         for e in range(config.moe.num_experts)])
    return out


def hf_state_from_dtmega(state: dict[str, torch.Tensor], config: DeepSeekConfig) -> dict[str, torch.Tensor]:
    """The HF checkpoint tensors (DeepSeek's per-expert layout, rotary rows paired as
    `rope_interleave=True` reads them) of dtmega's full state dict."""
    out: dict[str, torch.Tensor] = {}
    layer = re.compile(r"layers\.(\d+)\.(.+)")
    for name, tensor in state.items():
        if name in _TOP:
            if not (name == "output.weight" and config.tie_embeddings):
                out[_TOP[name]] = tensor
            continue
        match = layer.fullmatch(name)
        if match is None:
            raise KeyError(f"{name} has no DeepseekV3ForCausalLM counterpart")
        index, rest = match.groups()
        p = f"model.layers.{index}."
        parts = rest.split(".")
        if rest == "attention_norm.weight":
            out[p + "input_layernorm.weight"] = tensor
        elif rest == "ffn_norm.weight":
            out[p + "post_attention_layernorm.weight"] = tensor
        elif parts[0] == "attention":
            out[f"{p}self_attn.{_ATTENTION[parts[1]]}.weight"] = tensor
        elif rest == "feed_forward.router.gate.weight":
            out[p + "mlp.gate.weight"] = tensor
        elif rest == "feed_forward.router.expert_bias":
            out[p + "mlp.gate.e_score_correction_bias"] = tensor
        elif parts[1] == "experts":
            for e in range(tensor.shape[0]):
                out[f"{p}mlp.experts.{e}.{_DENSE[parts[2]]}.weight"] = tensor[e]
        elif parts[1] == "shared_experts":
            out[f"{p}mlp.shared_experts.{_DENSE[parts[2]]}.weight"] = tensor
        elif parts[1] in _DENSE:
            out[f"{p}mlp.{_DENSE[parts[1]]}.weight"] = tensor
        else:
            raise KeyError(f"{name} has no DeepseekV3ForCausalLM counterpart")
    return out
