"""Where each dtmega Qwen3-MoE weight lives in a Hugging Face Qwen3MoeForCausalLM checkpoint:
Qwen3's names (dtmega/models/qwen3/hf_names.py: Llama's plus the per-head q/k norms) and, in MoE
blocks, the router `mlp.gate` and one SwiGLU per expert, `mlp.experts.{e}.gate_proj/up_proj/
down_proj` (stacked on dim 0 in dtmega's grouped experts)."""

from __future__ import annotations

import re

import torch

from dtmega.models.llama.config import LlamaConfig
from dtmega.models.llama.hf_names import WeightSource
from dtmega.models.qwen3.hf_names import hf_source as qwen3_source
from dtmega.models.qwen3.hf_names import hf_tensors as qwen3_tensors

_EXPERTS = {"feed_forward.experts.w1": "gate_proj", "feed_forward.experts.w3": "up_proj",
            "feed_forward.experts.w2": "down_proj"}
_ROUTER = "feed_forward.router.gate.weight"
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")

NAME_TABLE = [("layers.{i}." + _ROUTER, "model.layers.{i}.mlp.gate.weight")] + [
    (f"layers.{{i}}.{ours}[e]", f"model.layers.{{i}}.mlp.experts.{{e}}.{theirs}.weight")
    for ours, theirs in _EXPERTS.items()
]


def hf_source(name: str, config: LlamaConfig, hf_names: set[str] | None = None) -> WeightSource:
    """The HF tensor(s) dtmega's `name` is read from; KeyError for a name with no HF counterpart."""
    match = _LAYER.fullmatch(name)
    if match is not None:
        index, rest = match.groups()
        prefix = f"model.layers.{index}.mlp."
        if rest == _ROUTER:
            return WeightSource((prefix + "gate.weight",))
        if rest in _EXPERTS:
            return WeightSource(tuple(f"{prefix}experts.{e}.{_EXPERTS[rest]}.weight"
                                      for e in range(config.moe.num_experts)), stacked=True)
    return qwen3_source(name, config, hf_names)


def hf_tensors(name: str, tensor: torch.Tensor, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """dtmega's full tensor `name` as the HF tensors it becomes (export)."""
    match = _LAYER.fullmatch(name)
    if match is not None and match.group(2) in (_ROUTER, *_EXPERTS):
        source = hf_source(name, config)
        return {hf: tensor[e] for e, hf in enumerate(source.names)} if source.stacked else {source.names[0]: tensor}
    return qwen3_tensors(name, tensor, config)
