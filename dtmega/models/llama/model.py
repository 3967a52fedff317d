"""The reference Llama: a plain, unsharded decoder that every plan is checked against.

Nothing here knows about parallelism. Passes find the pieces by name (`layers.N.attention.wq`,
`layers.N.attention.core`, ...) and shard or replace them; view shapes use -1 for the head count
so the same code runs on a tensor-parallel shard of the heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtmega.kernels.document_attention import document_attention
from dtmega.models.decoder import Decoder
from dtmega.models.feed_forward import FeedForward
from dtmega.models.kv_cache import LayerCache
from dtmega.models.llama.config import LlamaConfig
from dtmega.models.moe import MoE
from dtmega.models.rope import rope_cache
from dtmega.models.slots import RMSNorm, Rotary


class CoreAttention(nn.Module):
    """Causal softmax attention over [B, S, H, D] heads (GQA-aware).

    A module of its own so that recompute and context parallelism can find and wrap or
    replace exactly the attention core.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                q_offset: int | torch.Tensor = 0, documents=None) -> torch.Tensor:
        """`q_offset`: position of the first query among the keys (decoding with a KV cache); a
        tensor [B] gives each row its own (a batch of sequences of different lengths, as the
        server decodes them: row b's query i sees keys 0..q_offset[b] + i). `documents`: the
        packed-documents mask the model built for this forward (kernels/document_attention.py):
        causal within each document only."""
        if documents is not None:
            return document_attention(q, k, v, documents)
        mask, causal = None, True
        if isinstance(q_offset, torch.Tensor):
            causal = False
            query_pos = q_offset.to(q.device)[:, None] + torch.arange(q.shape[1], device=q.device)  # [B, Sq]
            mask = (torch.arange(k.shape[1], device=q.device)[None, None, :] <= query_pos[:, :, None])[:, None]
        elif q_offset:
            causal = False
            query_pos = torch.arange(q.shape[1], device=q.device) + q_offset
            mask = torch.arange(k.shape[1], device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, is_causal=causal, enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.transpose(1, 2)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings, and per-head RMSNorm on queries and keys
    before RoPE where the config asks (`qk_norm`: Qwen3's, Megatron's --qk-layernorm).

    Slots (modules the forward calls, which passes swap, never this forward): `q_norm` and
    `k_norm` (None without qk_norm), `rotary` (RoPE on q and k together), `core` (the softmax
    attention)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        self.q_norm = RMSNorm(config.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.rotary = Rotary()
        self.core = CoreAttention()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None,
                documents=None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, rope)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if documents is not None:
            out = self.core(q, k, v, documents=documents)
        elif cache is None:
            out = self.core(q, k, v)
        else:
            offset = cache.owner.length
            k, v = cache.update(k, v)
            out = self.core(q, k, v, q_offset=offset)
        return self.wo(out.reshape(batch, seq, -1))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then MLP (a mixture of experts on MoE layers).

    Slots: `attention_norm`, `attention`, `ffn_norm` (which also does the residual add before it:
    `add_then_norm`), `feed_forward`. A family with another attention passes its class
    (`attention_class`, DeepSeek's MLA)."""

    attention_class: type[nn.Module] = Attention

    def __init__(self, config, index: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = self.attention_class(config)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        if config.moe is not None and config.moe.is_moe_layer(index):
            self.feed_forward: nn.Module = MoE(config.dim, config.moe)
        else:
            self.feed_forward = FeedForward(config.dim, config.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None,
                documents=None) -> torch.Tensor:
        if documents is None:
            attended = self.attention(self.attention_norm(x), rope, cache=cache)
        else:
            attended = self.attention(self.attention_norm(x), rope, cache=cache, documents=documents)
        normed, h = self.ffn_norm.add_then_norm(x, attended)
        return h + self.feed_forward(normed)


class Llama(Decoder):
    """Llama-3 decoder. Build it under `torch.device("meta")`, shard it, then `init_weights()`."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, i) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)

    def _rope_cache(self, device=None) -> torch.Tensor:
        c = self.config
        return rope_cache(c.max_seq_len, c.head_dim, c.rope_theta, c.rope_scaling, device=device)
