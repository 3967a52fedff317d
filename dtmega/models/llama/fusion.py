"""Where dtmega's Llama has its hot paths, and its forwards through the fused kernels: what
`FuseKernels` needs of this family (registered with `register_fusion`, beside the family itself).

Norms run `rms_norm`; each block's residual add and its second norm `rms_norm_residual` (the
block's forward is rewritten around it); the MLP's activation `swiglu`; q and k their RoPE in one
`rope_qk` launch.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dtmega.kernels.rmsnorm import rms_norm_residual
from dtmega.kernels.rope import apply_rope_qk
from dtmega.models.feed_forward import FeedForward
from dtmega.passes.fusion_sites import fused_rms_norm, norm_eps, register_fusion, swiglu_w123


def fusion_sites(model: nn.Module) -> dict[str, list[str]]:
    """The module FQNs of each fused op in a dtmega Llama."""
    blocks = [f"layers.{name}" for name in model.layers]
    return {
        "rms_norm": [f"{b}.attention_norm" for b in blocks] + ["norm"],
        "rms_norm_residual": [f"{b}.ffn_norm" for b in blocks],
        "swiglu": [fqn for fqn, m in model.named_modules() if isinstance(m, FeedForward)],
        "rope": [f"{b}.attention" for b in blocks],
    }


def fused_rope_attention(module: nn.Module, impl: str) -> Callable:
    """dtmega's Attention with q and k rotated by one kernel. The model hands each block the
    cos/sin rows of its positions ([1 or B, S, D/2, 2]); they are the kernel's table, read at
    index b * S + s."""
    plain = module.forward

    def forward(x, rope, cache=None, documents=None):
        if cache is not None:  # decoding with a KV cache: the plain path
            return plain(x, rope, cache=cache)
        batch, seq, _ = x.shape
        table = rope[0] if rope.shape[0] == 1 else rope.flatten(0, 1)
        positions = None if rope.shape[0] == 1 else torch.arange(batch * seq, device=x.device).view(batch, seq)
        q = module.wq(x).view(batch, seq, -1, module.head_dim)
        k = module.wk(x).view(batch, seq, -1, module.head_dim)
        v = module.wv(x).view(batch, seq, -1, module.head_dim)
        q, k = apply_rope_qk(q, k, table, positions, impl=impl)
        out = module.core(q, k, v) if documents is None else module.core(q, k, v, documents=documents)
        return module.wo(out.reshape(batch, seq, -1))

    return forward


def fuse_block_residual(block: nn.Module, impl: str) -> None:
    """dtmega's TransformerBlock with the residual add and ffn_norm fused (rms_norm_residual)."""
    eps = norm_eps(block.ffn_norm)

    def forward(x, rope, cache=None, documents=None):
        extra = {} if documents is None else {"documents": documents}
        attended = block.attention(block.attention_norm(x), rope, cache=cache, **extra)
        # The residual stream keeps its dtype (fp32 under autocast, where the attention's output
        # is bf16), as `x + attended` would by type promotion.
        normed, h = rms_norm_residual(x, attended.to(x.dtype), block.ffn_norm.weight, eps, impl=impl)
        return h + block.feed_forward(normed)

    block.forward = forward


register_fusion("dtmega-llama", fusion_sites,
                {"rms_norm": fused_rms_norm, "swiglu": swiglu_w123, "rope": fused_rope_attention},
                block_residual=fuse_block_residual)
