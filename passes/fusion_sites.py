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

from dtmega.kernels.rmsnorm import rms_norm, rms_norm_residual
from dtmega.kernels.rope import apply_rope_qk
from dtmega.kernels.swiglu import swiglu

OPS = ("rms_norm", "rms_norm_residual", "swiglu", "rope")
SITES: dict[str, Callable[[nn.Module], dict[str, list[str]]]] = {}
FORWARDS: dict[tuple[str, str], Callable[[nn.Module, str], Callable]] = {}


def register_fusion(family: str, sites: Callable[[nn.Module], dict[str, list[str]]],
                    forwards: dict[str, Callable[[nn.Module, str], Callable]]) -> None:
    """Declares a family's fusion sites and, per op, how a module of it runs fused."""
    SITES[family] = sites
    for op, make in forwards.items():
        FORWARDS[(family, op)] = make


def _norm_eps(module: nn.Module) -> float:
    eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", None)
    return float(eps) if eps is not None else float(torch.finfo(torch.float32).eps)


def fused_rms_norm(module: nn.Module, impl: str) -> Callable:
    """RMSNorm (torch's, Hugging Face's LlamaRMSNorm, torchtitan's) through the fused op."""
    eps = _norm_eps(module)
    return lambda x: rms_norm(x, module.weight, eps, impl=impl)


def _dtmega_sites(model: nn.Module) -> dict[str, list[str]]:
    from dtmega.models.feed_forward import FeedForward

    blocks = [f"layers.{name}" for name in model.layers]
    return {
        "rms_norm": [f"{b}.attention_norm" for b in blocks] + ["norm"],
        "rms_norm_residual": [f"{b}.ffn_norm" for b in blocks],
        "swiglu": [fqn for fqn, m in model.named_modules() if isinstance(m, FeedForward)],
        "rope": [f"{b}.attention" for b in blocks],
    }


def _dtmega_swiglu(module: nn.Module, impl: str) -> Callable:
    return lambda x: module.w2(swiglu(module.w1(x), module.w3(x), impl=impl))


def _dtmega_rope(module: nn.Module, impl: str) -> Callable:
    """dtmega's Attention with q and k rotated by one kernel. The model hands each block the
    cos/sin rows of its positions ([1 or B, S, D/2, 2]); they are the kernel's table, read at
    index b * S + s."""
    plain = module.forward

    def forward(x, rope, cache=None):
        if cache is not None:  # decoding with a KV cache: the plain path
            return plain(x, rope, cache=cache)
        batch, seq, _ = x.shape
        table = rope[0] if rope.shape[0] == 1 else rope.flatten(0, 1)
        positions = None if rope.shape[0] == 1 else torch.arange(batch * seq, device=x.device).view(batch, seq)
        q = module.wq(x).view(batch, seq, -1, module.head_dim)
        k = module.wk(x).view(batch, seq, -1, module.head_dim)
        v = module.wv(x).view(batch, seq, -1, module.head_dim)
        q, k = apply_rope_qk(q, k, table, positions, impl=impl)
        return module.wo(module.core(q, k, v).reshape(batch, seq, -1))

    return forward


def _dtmega_block_residual(norm: nn.Module, impl: str) -> Callable:
    """The ffn_norm of a dtmega block: its block's `h = x + attention(...)` and the norm of h
    in one kernel (the block's forward is rewritten around it, see `fuse_block_residual`)."""
    return fused_rms_norm(norm, impl)


def fuse_block_residual(block: nn.Module, impl: str) -> None:
    """dtmega's TransformerBlock with the residual add and ffn_norm fused (rms_norm_residual)."""
    eps = _norm_eps(block.ffn_norm)

    def forward(x, rope, cache=None):
        attended = block.attention(block.attention_norm(x), rope, cache=cache)
        # The residual stream keeps its dtype (fp32 under autocast, where the attention's output
        # is bf16), as `x + attended` would by type promotion.
        normed, h = rms_norm_residual(x, attended.to(x.dtype), block.ffn_norm.weight, eps, impl=impl)
        return h + block.feed_forward(normed)

    block.forward = forward


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


register_fusion("dtmega-llama", _dtmega_sites, {
    "rms_norm": fused_rms_norm, "rms_norm_residual": _dtmega_block_residual, "swiglu": _dtmega_swiglu,
    "rope": _dtmega_rope,
})
# Hugging Face's and torchtitan's RoPE use layouts of their own (rotate-half cos/sin, complex
# frequencies): their attention keeps its RoPE; norms, SwiGLU and the loss are fused.
register_fusion("hf-llama", _hf_sites, {"rms_norm": fused_rms_norm, "swiglu": _hf_swiglu})
register_fusion("torchtitan-llama3", _torchtitan_sites, {"rms_norm": fused_rms_norm, "swiglu": _dtmega_swiglu})
