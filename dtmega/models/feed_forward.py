"""The SwiGLU MLP of the Llama family (dense blocks, and the shared experts of MoE blocks)."""

from __future__ import annotations

import torch
from torch import nn

from dtmega.models.slots import SwiGLU


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(act(w1 x, w3 x)), act = silu(gate) * up (the `act` slot, which FuseKernels
    swaps for its kernel)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.act = SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x), self.w3(x)))
