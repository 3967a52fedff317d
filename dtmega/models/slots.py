"""The seams of dtmega's decoder blocks: small modules the block's own forward calls, so that a pass
changes how an op runs by swapping the module in its slot, never by rewriting a forward.

- `RMSNorm`: torch's RMSNorm plus the residual add a block does before its second norm
  (`add_then_norm`), so a fused add + norm kernel can take both (FuseKernels swaps the module);
- `Rotary`: RoPE on queries and keys, one call for both (a one-launch kernel takes both);
- `SwiGLU`: the gated activation of an MLP, silu(gate) * up.

Each is what the block computes, written once; `passes/fused_modules.py` holds the same ops run
by dtmega's kernels, with the same call signatures and the same parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtmega.models.rope import apply_rope


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm, and the residual add before it."""

    def add_then_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + delta), x + delta): a block's residual add and its next norm. The residual
        stream keeps its dtype (fp32 under autocast, where `delta` may be bf16), as `x + delta`
        would by type promotion."""
        summed = x + delta.to(x.dtype)
        return self(summed), summed


class Rotary(nn.Module):
    """Rotary position embeddings on queries [B, S, Hq, D] and keys [B, S, Hk, D] by the cos/sin
    rows of their positions [1 or B, S, D/2, 2] (Meta's interleaved-pair convention)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, rope), apply_rope(k, rope)


class SwiGLU(nn.Module):
    """The gated linear unit's activation: silu(gate) * up."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up
