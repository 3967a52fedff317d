"""Qwen3's named sizes as model specs: `--model qwen3-8b` etc. (sizes in config.py)."""

from __future__ import annotations

import dataclasses

from dtmega.models.llama.specs import llama_spec
from dtmega.models.qwen3.config import QWEN3_SIZES
from dtmega.models.qwen3.model import Qwen3
from dtmega.models.registry import ModelSpec


def qwen3_spec(name: str, config) -> ModelSpec:
    """The spec of one Qwen3 size (its sizes are its own: Megatron's size flags build a Qwen3 as
    `--qk-layernorm` with them, recorded as "qwen3")."""
    return llama_spec(name, config, family="dtmega-qwen3", build=Qwen3, size_flags=False, title="Qwen3")


QWEN3_SPECS: tuple[ModelSpec, ...] = (
    *(qwen3_spec(name, config) for name, config in QWEN3_SIZES.items()),
    # what a Qwen3 sized by Megatron's flags, or read from Hugging Face, records: any size
    dataclasses.replace(qwen3_spec("qwen3", QWEN3_SIZES["qwen3-debug"]), description="Qwen3 (any size)"),
)
