"""Where a model's hot paths are: the slot modules `FuseKernels` may swap for fused kernels.

A family says where its sites are (`ModelFamily.fusion_sites(model) -> {op: [module FQNs]}`, ops
of passes/fused_ops.py: "rms_norm", "rms_norm_residual", "rope", "swiglu"); each site is a module
the model's own forward calls (passes/fused_modules.py's `KNOWN` says which classes each op may
replace). These helpers find the usual sites by class, for the built-in families and one's own.

Hugging Face's and torchtitan's decoders compute RoPE and the SwiGLU product inside their
attention and MLP forwards, not in a module of their own: there the sites are their norms, and
the loss (which FuseKernels fuses for every family); their attention and MLP run as written.
"""

from __future__ import annotations

from torch import nn


def modules_of(model: nn.Module, *kinds: tuple[str, str]) -> list[str]:
    """FQNs of the modules whose class is one of `kinds` ((module path, class name)) or derives
    from one: a subclass is a site too, so that FuseKernels refuses it by name (it may compute
    or hold more than the kernel knows) instead of passing it over."""
    return [fqn for fqn, module in model.named_modules()
            if fqn and any((cls.__module__, cls.__name__) in kinds for cls in type(module).__mro__)]


def slot_sites(model: nn.Module, residual_norms: list[str]) -> dict[str, list[str]]:
    """The sites of a model built from dtmega's slots (dtmega/models/slots.py): every RMSNorm (the
    `residual_norms`, which blocks call with their residual add, take the add + norm kernel),
    every Rotary and every SwiGLU."""
    residual = set(residual_norms)
    norms = modules_of(model, ("dtmega.models.slots", "RMSNorm"))
    return {
        "rms_norm": [fqn for fqn in norms if fqn not in residual],
        "rms_norm_residual": [fqn for fqn in norms if fqn in residual],
        "rope": modules_of(model, ("dtmega.models.slots", "Rotary")),
        "swiglu": modules_of(model, ("dtmega.models.slots", "SwiGLU")),
    }


def norm_sites(model: nn.Module) -> dict[str, list[str]]:
    """A foreign decoder's sites: its RMSNorm modules (torch's, Hugging Face's)."""
    return {"rms_norm": [fqn for fqn, module in model.named_modules()
                         if fqn and type(module).__name__.endswith("RMSNorm")]}
