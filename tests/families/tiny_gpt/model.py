"""A decoder of one's own: pre-norm blocks of causal attention (no position encoding: the causal
mask orders the tokens) and a SwiGLU MLP, named unlike any built-in family."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TinyGPTConfig:
    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int = 128
    max_len: int = 256

    def to_dict(self) -> dict:
        return asdict(self)


class Attention(nn.Module):
    def __init__(self, config: TinyGPTConfig):
        super().__init__()
        self.head_dim = config.dim // config.heads
        self.q, self.k, self.v = (nn.Linear(config.dim, config.dim, bias=False) for _ in range(3))
        self.o = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: the local heads when tensor parallelism splits q, k and v column-wise
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: TinyGPTConfig):
        super().__init__()
        self.gate = nn.Linear(config.dim, config.ffn, bias=False)
        self.up = nn.Linear(config.dim, config.ffn, bias=False)
        self.down = nn.Linear(config.ffn, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, config: TinyGPTConfig):
        super().__init__()
        self.ln_attn, self.ln_mlp = nn.RMSNorm(config.dim), nn.RMSNorm(config.dim)
        self.attn, self.mlp = Attention(config), MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class TinyGPT(nn.Module):
    def __init__(self, config: TinyGPTConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.RMSNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))
