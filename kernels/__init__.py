"""dtmega.kernels: the leaf layer. Hot-path ops with a plain-PyTorch reference; imports nothing
of dtmega's. Names are imported on first use (PEP 562), so `dtmega.kernels.errors`, the base
of every input error, costs no torch import (the preprocess workers use it)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "context_parallel_attention": "dtmega.kernels.context_attention",
    "CommStats": "dtmega.kernels.context_shards",
    "token_indices": "dtmega.kernels.context_shards",
    "cross_entropy_context": "dtmega.kernels.cross_entropy",
    "is_vocab_sharded": "dtmega.kernels.cross_entropy",
    "per_token_cross_entropy": "dtmega.kernels.cross_entropy",
    "KernelSpec": "dtmega.kernels.registry",
    "kernel_spec": "dtmega.kernels.registry",
    "kernels_for": "dtmega.kernels.registry",
    "register_kernel": "dtmega.kernels.registry",
    "registered_kernels": "dtmega.kernels.registry",
    "DtmegaError": "dtmega.kernels.errors",
    "MissingInput": "dtmega.kernels.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dtmega.kernels' has no attribute {name!r}")
