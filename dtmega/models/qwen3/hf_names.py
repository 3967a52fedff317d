"""Where each dtmega Qwen3 weight lives in a Hugging Face Qwen3ForCausalLM checkpoint: Llama's
names (dtmega/models/llama/hf_names.py) plus the per-head q/k norms, whose channels take the
same RoPE reordering as the q/k projection rows (a norm weight is one head's channels: dtmega
channel 2i + p is HF channel p * head_dim/2 + i)."""

from __future__ import annotations

import re

import torch

from dtmega.models.llama.config import LlamaConfig
from dtmega.models.llama.hf_names import WeightSource, dtmega_rows_to_hf, hf_rows_to_dtmega
from dtmega.models.llama.hf_names import hf_source as llama_source
from dtmega.models.llama.hf_names import hf_tensors as llama_tensors

_NORMS = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")

NAME_TABLE = [(f"layers.{{i}}.{ours}", f"model.layers.{{i}}.{theirs}") for ours, theirs in _NORMS.items()]


def _channels_to_dtmega(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """An HF q/k norm weight [head_dim] in dtmega's (interleaved-pair) channel order."""
    return hf_rows_to_dtmega(weight.unsqueeze(-1), heads).squeeze(-1)


def hf_source(name: str, config: LlamaConfig, hf_names: set[str] | None = None) -> WeightSource:
    """The HF tensor dtmega's `name` is read from; KeyError for a name with no HF counterpart."""
    match = _LAYER.fullmatch(name)
    if match is not None and match.group(2) in _NORMS:
        hf = f"model.layers.{match.group(1)}.{_NORMS[match.group(2)]}"
        return WeightSource((hf,), heads=1, head_dim=config.head_dim, reorder=_channels_to_dtmega)
    return llama_source(name, config, hf_names)


def hf_tensors(name: str, tensor: torch.Tensor, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """dtmega's full tensor `name` as the HF tensors it becomes (export)."""
    match = _LAYER.fullmatch(name)
    if match is not None and match.group(2) in _NORMS:
        (hf,) = hf_source(name, config).names
        return {hf: dtmega_rows_to_hf(tensor.unsqueeze(-1), 1).squeeze(-1)}
    return llama_tensors(name, tensor, config)
