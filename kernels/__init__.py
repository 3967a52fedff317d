"""dtmega.kernels: the leaf layer. Hot-path ops with a plain-PyTorch reference; imports nothing
of dtmega's. Names are imported on first use (PEP 562), so `dtmega.kernels.errors`, the base
of every input error, costs no torch import (the preprocess workers use it).

The kernels of docs/kernels.md's table are exported by their table names (`from dtmega.kernels
import fused_linear_cross_entropy, rope_qk`). Three share their module's name (`swiglu`,
`fused_linear_cross_entropy`, `recomputed_attention`): the package attribute is the function even
after the module is imported (Python would set it to the module then), so reach those modules with
`from dtmega.kernels.swiglu import ...` or `importlib.import_module`, not `import ... as`."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

# the kernel table's functions: name -> (module, attribute); rope_qk is the op `apply_rope_qk` calls
_KERNELS = {
    "rms_norm": ("dtmega.kernels.rmsnorm", "rms_norm"),
    "rms_norm_residual": ("dtmega.kernels.rmsnorm", "rms_norm_residual"),
    "swiglu": ("dtmega.kernels.swiglu", "swiglu"),
    "swiglu_packed": ("dtmega.kernels.swiglu", "swiglu_packed"),
    "rope_qk": ("dtmega.kernels.rope", "apply_rope_qk"),
    "apply_rope_qk": ("dtmega.kernels.rope", "apply_rope_qk"),
    "fused_linear_cross_entropy": ("dtmega.kernels.fused_linear_cross_entropy", "fused_linear_cross_entropy"),
    "fused_linear_cross_entropy_sum": ("dtmega.kernels.fused_linear_cross_entropy", "fused_linear_cross_entropy_sum"),
    "recomputed_attention": ("dtmega.kernels.recomputed_attention", "recomputed_attention"),
}

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

__all__ = sorted([*_EXPORTS, *_KERNELS])


def __getattr__(name: str) -> Any:
    if name in _KERNELS:
        module, attribute = _KERNELS[name]
        return getattr(importlib.import_module(module), attribute)
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dtmega.kernels' has no attribute {name!r}")


class _Package(types.ModuleType):
    """This package's module type: importing a submodule named like a kernel it holds
    (`dtmega.kernels.swiglu`) sets the package attribute to the kernel, not to the module."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _KERNELS.get(name, ("", ""))[0] == value.__name__:
            value = getattr(value, _KERNELS[name][1])
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
