"""Where each model family's hot paths are, and the forwards that run them through the fused
kernels of `dtmega.kernels`: what `FuseKernels` needs to know per family.

A site list names module FQNs per op ("rms_norm", "rms_norm_residual", "swiglu", "rope");
`FORWARDS[(family, op)](module, impl)` returns the module's new forward. The output layer and
its loss are the same for every family (passes/fuse_kernels.py). A family of one's own adds its
entries with `register_fusion`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dtmega.kernels.rmsnorm import rms_norm
from dtmega.kernels.swiglu import swiglu

SITES: dict[str, Callable[[nn.Module], dict[str, list[str]]]] = {}
FORWARDS: dict[tuple[str, str], Callable[[nn.Module, str], Callable]] = {}
# family -> how its block fuses the residual add into its second norm (rms_norm_residual): the
# block's forward is rewritten around the fused op, given the block and the impl
BLOCK_RESIDUALS: dict[str, Callable[[nn.Module, str], None]] = {}


def register_fusion(family: str, sites: Callable[[nn.Module], dict[str, list[str]]],
                    forwards: dict[str, Callable[[nn.Module, str], Callable]],
                    block_residual: Callable[[nn.Module, str], None] | None = None) -> None:
    """Declares a family's fusion sites and, per op, how a module of it runs fused (and, for
    rms_norm_residual, how its block is rewritten around the fused add + norm)."""
    SITES[family] = sites
    for op, make in forwards.items():
        FORWARDS[(family, op)] = make
    if block_residual is not None:
        BLOCK_RESIDUALS[family] = block_residual


def norm_eps(module: nn.Module) -> float:
    """The epsilon of an RMSNorm module (torch's `eps`, Hugging Face's `variance_epsilon`)."""
    eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", None)
    return float(eps) if eps is not None else float(torch.finfo(torch.float32).eps)


def fused_rms_norm(module: nn.Module, impl: str) -> Callable:
    """RMSNorm (torch's, Hugging Face's LlamaRMSNorm, torchtitan's) through the fused op."""
    eps = norm_eps(module)
    return lambda x: rms_norm(x, module.weight, eps, impl=impl)


def swiglu_w123(module: nn.Module, impl: str) -> Callable:
    """An MLP `w2(silu(w1 x) * w3 x)` (dtmega's, torchtitan's FeedForward) through the fused op."""
    return lambda x: module.w2(swiglu(module.w1(x), module.w3(x), impl=impl))


def _hf_sites(model: nn.Module) -> dict[str, list[str]]:
    norms = [fqn for fqn, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    mlps = [fqn for fqn, m in model.named_modules() if type(m).__name__ == "LlamaMLP"]
    return {"rms_norm": norms, "swiglu": mlps}


def _hf_swiglu(module: nn.Module, impl: str) -> Callable:
    return lambda x: module.down_proj(swiglu(module.gate_proj(x), module.up_proj(x), impl=impl))


def _torchtitan_sites(model: nn.Module) -> dict[str, list[str]]:
    norms = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.RMSNorm)]
    mlps = [fqn for fqn, m in model.named_modules() if type(m).__name__ == "FeedForward" and hasattr(m, "w3")]
    return {"rms_norm": norms, "swiglu": mlps}


# Hugging Face's and torchtitan's RoPE use layouts of their own (rotate-half cos/sin, complex
# frequencies): their attention keeps its RoPE; norms, SwiGLU and the loss are fused.
register_fusion("hf-llama", _hf_sites, {"rms_norm": fused_rms_norm, "swiglu": _hf_swiglu})
register_fusion("torchtitan-llama3", _torchtitan_sites, {"rms_norm": fused_rms_norm, "swiglu": swiglu_w123})
