"""The reference Llama: a plain, unsharded decoder that every plan is checked against.

Nothing here knows about parallelism. Passes find the pieces by name (`layers.N.attention.wq`,
`layers.N.attention.core`, ...) and shard or replace them; view shapes use -1 for the head count
so the same code runs on a tensor-parallel shard of the heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dtmega.init import InitSpec, init_parameters
from dtmega.kernels.document_attention import document_attention, document_mask, positions_from_documents
from dtmega.kernels.errors import DtmegaError
from dtmega.models.feed_forward import FeedForward
from dtmega.models.kv_cache import KVCache, LayerCache
from dtmega.models.llama.config import LlamaConfig
from dtmega.models.moe import MoE
from dtmega.models.rope import apply_rope, rope_cache


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
    """Grouped-query attention with rotary embeddings."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        self.core = CoreAttention()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None,
                documents=None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = apply_rope(self.wq(x).view(batch, seq, -1, self.head_dim), rope)
        k = apply_rope(self.wk(x).view(batch, seq, -1, self.head_dim), rope)
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
    """Pre-norm residual block: attention then MLP (a mixture of experts on MoE layers)."""

    def __init__(self, config: LlamaConfig, index: int = 0):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        if config.moe is not None and config.moe.is_moe_layer(index):
            self.feed_forward: nn.Module = MoE(config.dim, config.moe)
        else:
            self.feed_forward = FeedForward(config.dim, config.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None,
                documents=None) -> torch.Tensor:
        if documents is None:
            h = x + self.attention(self.attention_norm(x), rope, cache=cache)
        else:
            h = x + self.attention(self.attention_norm(x), rope, cache=cache, documents=documents)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama-3 decoder. Build it under `torch.device("meta")`, shard it, then `init_weights()`."""

    # How attention masks packed documents (kernels/document_attention.py): "sdpa" (a dense mask,
    # the default) or "flex"; the DocumentMasking pass sets it on every pipeline stage.
    document_backend = "sdpa"

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, i) for i in range(config.n_layers)})
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)

    def _rope_cache(self, device=None) -> torch.Tensor:
        c = self.config
        return rope_cache(c.max_seq_len, c.head_dim, c.rope_theta, c.rope_scaling, device=device)

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, vocab] for token ids [B, S]. position_ids [B, S] default to 0..S-1 (after
        the cached positions when decoding with a `cache`). `document_ids` [B, S] (packed
        documents: equal ids = one document) make attention causal within each document only,
        and positions restart per document unless `position_ids` say otherwise.

        A pipeline stage is this model with some pieces set to None: without an embedding it
        takes hidden states [B, S, D]; without norm and output it returns hidden states.
        """
        seq = tokens.shape[1]
        documents = None
        if document_ids is not None:
            if cache is not None:
                raise DtmegaError("document_ids with a KV cache: generation decodes one sequence per row. Fix: drop "
                                  "document_ids when generating")
            documents = document_mask(document_ids, self.document_backend)
            if position_ids is None:
                position_ids = positions_from_documents(document_ids)
        start = cache.length if cache is not None else 0
        if position_ids is None and start + seq > self.rope_cache.shape[0]:
            raise DtmegaError(
                f"{start + seq} positions, but the model's RoPE table has {self.rope_cache.shape[0]} "
                f"(LlamaConfig.max_seq_len). Fix: a shorter sequence, or a model config with max_seq_len >= {start + seq}"
            )
        if position_ids is None:
            rope = self.rope_cache[start:start + seq].unsqueeze(0)
        else:
            rope = self.rope_cache[position_ids]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for name, block in self.layers.items():
            if documents is not None:
                h = block(h, rope, documents=documents)
            else:
                h = block(h, rope) if cache is None else block(h, rope, cache=cache.layer(name))
        if cache is not None:
            cache.advance(seq)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def init_spec(self, name: str, param: nn.Parameter) -> InitSpec:
        """Megatron's scheme: N(0, std) everywhere, output projections of each block scaled by
        1/sqrt(2 * n_layers), norms at one."""
        std = self.config.init_std
        if param.ndim == 1:
            return InitSpec("ones")
        if name.endswith(("attention.wo.weight", "w2.weight", "experts.w2")):
            return InitSpec("trunc_normal", std / math.sqrt(2 * self.config.n_layers))
        if name == "tok_embeddings.weight":
            return InitSpec("normal", std)
        return InitSpec("trunc_normal", std)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | None = None) -> None:
        """Initializes parameters in place (sharded or not: same values) and rebuilds buffers."""
        self._tie()
        init_parameters(self, self.init_spec, seed=seed)
        self.init_buffers(buffer_device or self.rope_cache.device)

    def _tie(self) -> None:
        if self.config.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight  # to_empty() unties shared parameters

    def init_buffers(self, device: torch.device) -> None:
        """Re-ties a tied output layer and rebuilds the buffers (RoPE table, MoE counters) on
        `device`, leaving the parameters' values as they are: for weights loaded next."""
        self._tie()
        if device.type == "meta":
            return
        self.rope_cache = self._rope_cache(device)
        for module in self.modules():
            if hasattr(module, "reset_buffers"):
                module.reset_buffers(device)
