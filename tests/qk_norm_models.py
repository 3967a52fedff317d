"""A researcher's Llama subclass with per-head RMSNorm on queries and keys (Qwen3's attention),
written the way one writes it: a subclass of dtmega's Attention with its own forward, and a Llama
whose blocks use it. Issue 50 found it silently mis-trained: FuseKernels replaced the
attention's forward with a copy of Llama's (no norms), and tensor parallelism left the norms'
weights replicated with partial gradients. `norm_name` names the norms (`q_norm` is the name
dtmega's family rules know; another name must be refused, not guessed)."""

from __future__ import annotations

import torch
from torch import nn

from dtmega.models import Llama, LlamaConfig
from dtmega.models.llama.model import Attention
from dtmega.models.rope import apply_rope


class QKNormAttention(Attention):
    """Grouped-query attention with RMSNorm on each head of q and k before RoPE."""

    norm_name = "q_norm"

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        self.q_name, self.k_name = self.norm_name, "k" + self.norm_name[1:]
        setattr(self, self.q_name, nn.RMSNorm(config.head_dim, eps=config.norm_eps))
        setattr(self, self.k_name, nn.RMSNorm(config.head_dim, eps=config.norm_eps))

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache=None, documents=None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = getattr(self, self.q_name)(self.wq(x).view(batch, seq, -1, self.head_dim))
        k = getattr(self, self.k_name)(self.wk(x).view(batch, seq, -1, self.head_dim))
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        out = self.core(q, k, v) if documents is None else self.core(q, k, v, documents=documents)
        return self.wo(out.reshape(batch, seq, -1))


class OtherNames(QKNormAttention):
    norm_name = "q_layernorm"


def qk_llama(config: LlamaConfig, attention: type[Attention] = QKNormAttention) -> Llama:
    """A Llama (on the current device) whose blocks' attention is `attention`."""
    model = Llama(config)
    for block in model.layers.values():
        block.attention = attention(config)
    return model


def perturb_norms(model: nn.Module, seed: int) -> None:
    """The q/k norms' weights away from one (initialized at one, a dropped norm could hide)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and "attention." in name:
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=generator))
