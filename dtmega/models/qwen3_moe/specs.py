"""Qwen3-MoE's named sizes as model specs: `--model qwen3-30b-a3b` etc. (sizes in config.py)."""

from __future__ import annotations

import dataclasses

from dtmega.models.llama.specs import llama_spec
from dtmega.models.qwen3_moe.config import QWEN3_MOE_SIZES
from dtmega.models.qwen3_moe.model import Qwen3Moe
from dtmega.models.registry import ModelSpec


def qwen3_moe_spec(name: str, config) -> ModelSpec:
    """The spec of one Qwen3-MoE size (Megatron's flags build one as `--qk-layernorm` with
    `--num-experts`, recorded as "qwen3-moe")."""
    return llama_spec(name, config, family="dtmega-qwen3-moe", build=Qwen3Moe, size_flags=False, title="Qwen3-MoE")


QWEN3_MOE_SPECS: tuple[ModelSpec, ...] = (
    *(qwen3_moe_spec(name, config) for name, config in QWEN3_MOE_SIZES.items()),
    # what a Qwen3-MoE sized by Megatron's flags, or read from Hugging Face, records: any size
    dataclasses.replace(qwen3_moe_spec("qwen3-moe", QWEN3_MOE_SIZES["qwen3-moe-debug"]),
                        description="Qwen3-MoE (any size)"),
)
