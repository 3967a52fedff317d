"""The GPT family's reference decoder: Megatron's GPT blocks as `pretrain_gpt.py` builds them
from its flags (and GPT-2's, which are the same blocks), plain and unsharded.

    h = dropout(word(tokens) + position(positions))            learned_absolute (or RoPE / none)
    per block:  a = wo(attention(norm1(h))) + bias;  h = h + dropout(a)
                m = fc2(act(fc1(norm2(h)) + bias)) + bias;  h = h + dropout(m)
    logits = output(norm(h))                                     output tied to `word` by default

Slots are the Llama decoder's (`attention_norm`, `attention.{rotary,core}`, `ffn_norm` with
`add_then_norm`, `feed_forward.act`) plus two dropout slots per block; weights keep the names the
tensor-parallel rules know (`wq/wk/wv/wo`, `w1/w2/w3`), biases beside them. Dropout masks are a
function of each token's global sample and position (dtmega/models/gpt/dropout.py), so they do
not depend on the plan.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dtmega.init import InitSpec
from dtmega.kernels.document_attention import document_attention
from dtmega.kernels.errors import DtmegaError
from dtmega.models.decoder import Decoder
from dtmega.models.gpt.config import GPTConfig
from dtmega.models.gpt.dropout import KeyedDropout, attention_mask, site_id, token_keys
from dtmega.models.kv_cache import KVCache, LayerCache
from dtmega.models.moe import MoE
from dtmega.models.rope import rope_cache
from dtmega.models.slots import RMSNorm, Rotary, SwiGLU


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm, and the residual add before it (as slots.RMSNorm)."""

    def add_then_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + delta), x + delta): a block's residual add and its next norm."""
        summed = x + delta.to(x.dtype)
        return self(summed), summed


class LayerNorm1P(LayerNorm):
    """Megatron's --apply-layernorm-1p: the weight is stored zero-centred and applied as 1 + w."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class RMSNorm1P(RMSNorm):
    """RMSNorm with Megatron's zero-centred weight (1 + w)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


def make_norm(config: GPTConfig, width: int | None = None) -> nn.Module:
    """The config's norm layer over the model width (or `width`: a head's, for the q/k norms)."""
    width = width or config.dim
    if config.normalization == "LayerNorm":
        return (LayerNorm1P if config.layernorm_1p else LayerNorm)(width, eps=config.norm_eps)
    return (RMSNorm1P if config.layernorm_1p else RMSNorm)(width, eps=config.norm_eps)


class GeLU(nn.Module):
    """GeLU (tanh form: Megatron's fused bias-GeLU and GPT-2's gelu_new; or the exact erf form)."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)


class SquaredReLU(nn.Module):
    """relu(x)^2 (Megatron's --squared-relu)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


class MLP(nn.Module):
    """fc2(act(fc1 x)) with biases: GeLU or squared ReLU on one projection (`w1`), or SwiGLU on two
    (`w1` the gate, `w3` the up projection). The activation is the `act` slot."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.hidden_ffn
        self.w1 = nn.Linear(config.dim, hidden, bias=config.bias)
        self.w2 = nn.Linear(hidden, config.dim, bias=config.bias)
        self.gated = config.activation == "swiglu"
        self.w3 = nn.Linear(config.dim, hidden, bias=config.bias) if self.gated else None
        if self.gated:
            self.act: nn.Module = SwiGLU()
        else:
            self.act = GeLU(config.gelu_approximate) if config.activation == "gelu" else SquaredReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.w1(x), self.w3(x)) if self.gated else self.act(self.w1(x))
        return self.w2(hidden)


def _head_offset(weight: torch.Tensor, head_dim: int) -> int:
    """The first head this rank's rows of a column-sharded projection hold (0 when whole)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return offset[0] // head_dim


class CoreAttention(nn.Module):
    """Causal softmax attention over [B, S, H, D] heads with dropout on the probabilities.

    Without dropout (evaluation, generation, p = 0) it is SDPA, as the Llama's core; in training
    with p > 0 it computes the probabilities, drops them with plan-independent masks (`keys`:
    the query tokens' keys; `head_offset`: this rank's first head) and multiplies by the values."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p
        self.attention_dropout_p = p  # what passes that replace a core check (passes/slots.py)
        self.site = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int | torch.Tensor = 0,
                documents=None, keys: torch.Tensor | None = None, head_offset: int = 0) -> torch.Tensor:
        grouped = q.shape[2] != k.shape[2]
        if self.training and self.p > 0 and keys is not None:
            return self._dropped(q, k, v, documents, keys, head_offset)
        if documents is not None:
            return document_attention(q, k, v, documents)
        mask, causal = None, True
        if isinstance(q_offset, torch.Tensor):
            causal = False
            query_pos = q_offset.to(q.device)[:, None] + torch.arange(q.shape[1], device=q.device)
            mask = (torch.arange(k.shape[1], device=q.device)[None, None, :] <= query_pos[:, :, None])[:, None]
        elif q_offset:
            causal = False
            query_pos = torch.arange(q.shape[1], device=q.device) + q_offset
            mask = torch.arange(k.shape[1], device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=causal, enable_gqa=grouped)
        return out.transpose(1, 2)

    def _dropped(self, q, k, v, documents, keys, head_offset):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, D]
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        compute = torch.promote_types(q.dtype, torch.float32)  # the softmax in fp32 for bf16, float64 stays
        scores = (q @ k.transpose(-1, -2)).to(compute) / math.sqrt(q.shape[-1])
        seq = q.shape[2]
        allowed = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        if isinstance(documents, torch.Tensor) and documents.dtype == torch.bool:  # sdpa's dense [B, 1, S, S]
            allowed = documents
        elif isinstance(documents, torch.Tensor):  # document ids [B, S]
            allowed = (allowed & (documents[:, :, None] == documents[:, None, :]))[:, None]
        elif documents is not None:
            raise DtmegaError("attention dropout with packed documents needs the dense or varlen document mask, not "
                              f"{type(documents).__name__}. Fix: the DocumentMasking pass's backend='sdpa', or "
                              "--attention-dropout 0")
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        keep = attention_mask(keys, self.site, q.shape[1], k.shape[2], self.p, head_offset)
        probs = probs * keep / (1.0 - self.p)
        return (probs.to(v.dtype) @ v).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head (or grouped-query) attention with biases and, for position_embedding="rope",
    rotary embeddings; with `qk_norm` (Megatron's --qk-layernorm) each query and key head is
    normalized (the block's norm kind over the head width) before RoPE. Slots: `q_norm`/`k_norm`
    (None without qk_norm), `rotary` (None without RoPE) and `core`."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        q, kv = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, q, bias=config.has_qkv_bias)
        self.wk = nn.Linear(config.dim, kv, bias=config.has_qkv_bias)
        self.wv = nn.Linear(config.dim, kv, bias=config.has_qkv_bias)
        self.wo = nn.Linear(q, config.dim, bias=config.bias)
        self.q_norm = make_norm(config, config.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, config.head_dim) if config.qk_norm else None
        self.rotary = Rotary() if config.position_embedding == "rope" else None
        self.core = CoreAttention(config.attention_dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, cache: LayerCache | None = None,
                documents=None, keys: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self._rotate(q, k, rope)
        if cache is not None:
            offset = cache.owner.length
            k, v = cache.update(k, v)
            out = self.core(q, k, v, q_offset=offset)
        elif keys is not None and self.training:
            out = self.core(q, k, v, documents=documents, keys=keys,
                            head_offset=_head_offset(self.wq.weight, self.head_dim))
        elif documents is not None:
            out = self.core(q, k, v, documents=documents)
        else:
            out = self.core(q, k, v)
        return self.wo(out.reshape(batch, seq, -1))


    def _rotate(self, q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on the channels the table covers (all, or --rotary-percent's first share of each
        head, as Megatron's partial rotary); the rest pass through."""
        rotated = 2 * rope.shape[-2]
        if rotated == self.head_dim:
            return self.rotary(q, k, rope)
        (q_rot, q_pass), (k_rot, k_pass) = (t.split([rotated, self.head_dim - rotated], dim=-1) for t in (q, k))
        q_rot, k_rot = self.rotary(q_rot, k_rot, rope)
        return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1)


class TransformerBlock(nn.Module):
    """Megatron's GPT layer: pre-norm attention and MLP, each output dropped before its residual
    add. Slots: `attention_norm`, `attention`, `attention_dropout`, `ffn_norm` (`add_then_norm`),
    `feed_forward` (an MLP, or a mixture of experts on MoE layers), `mlp_dropout`."""

    def __init__(self, config: GPTConfig, index: int = 0):
        super().__init__()
        self.attention_norm = make_norm(config)
        self.attention = Attention(config)
        self.attention_dropout = KeyedDropout(config.hidden_dropout)
        self.ffn_norm = make_norm(config)
        self.feed_forward: nn.Module = MoE(config.dim, config.moe) if config.is_moe_layer(index) else MLP(config)
        self.mlp_dropout = KeyedDropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, cache: LayerCache | None = None,
                documents=None, keys: torch.Tensor | None = None) -> torch.Tensor:
        attended = self.attention(self.attention_norm(x), rope, cache=cache, documents=documents, keys=keys)
        normed, h = self.ffn_norm.add_then_norm(x, self.attention_dropout(attended, keys=keys))
        return h + self.mlp_dropout(self.feed_forward(normed), keys=keys)


class Embedding(nn.Module):
    """Word embedding plus learned absolute positions (`position`, None for RoPE or no positions),
    then dropout (Megatron's embedding dropout, p = hidden dropout)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.dim)
        learned = config.position_embedding == "learned_absolute"
        self.position = nn.Embedding(config.max_seq_len, config.dim) if learned else None
        self.dropout = KeyedDropout(config.hidden_dropout)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        h = self.word(tokens)
        if self.position is not None:
            h = h + self.position(positions)
        return self.dropout(h, keys=keys)


class GPT(Decoder):
    """Megatron's GPT model. Build it under `torch.device("meta")`, shard it, then `init_weights()`.

    `dropout_seed` keys the masks (the trainer sets --seed); `sample_ids` of a forward are the
    samples' indices in the global batch order (default: counted, see `_sample_ids`)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, i) for i in range(config.n_layers)})
        self.norm = make_norm(config)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.embedding.word.weight
        self.dropout_seed = 0
        self.samples_seen = 0  # training samples this module has run forward (its data-parallel share)
        self.data_parallel = (0, 1)  # (rank, size): set by the DataParallel pass
        self.counting = True
        for name, module in self.named_modules():
            if isinstance(module, (KeyedDropout, CoreAttention)):
                module.site = site_id(name)
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)

    @property
    def tok_embeddings(self) -> nn.Module | None:
        """The word embedding (what generic code calls the input embedding); None on a pipeline
        stage without the embedding."""
        return self.embedding.word if self.embedding is not None else None

    def set_data_parallel_rank(self, rank: int, size: int) -> None:
        """Tells dropout which share of each global batch this replica's samples are (Megatron's
        sampler: micro-step j of rank r holds global samples j*m*size + r*m .. + m)."""
        self.data_parallel = (rank, size)

    def set_dropout_state(self, seed: int, samples_before: int) -> None:
        """The run's dropout seed and the global samples trained before the next step (the trainer
        calls it at every step: a resumed or re-run step draws the masks it drew before)."""
        self.dropout_seed = seed
        self.samples_seen = samples_before // self.data_parallel[1]

    def _rope_cache(self, device=None) -> torch.Tensor:
        c = self.config
        if c.position_embedding != "rope":
            return torch.zeros(0, device=device)
        return rope_cache(c.max_seq_len, c.rotary_dim, c.rope_theta, None, device=device)  # --rotary-percent's share

    def _dropping(self) -> bool:
        c = self.config
        return self.training and torch.is_grad_enabled() and (c.hidden_dropout > 0 or c.attention_dropout > 0)

    def _sample_ids(self, batch: int, device) -> torch.Tensor:
        """Global sample indices of this forward's rows: this replica's next `batch` samples in
        Megatron's data-parallel order (counted per training forward, so micro-batches, pipeline
        stages and data-parallel ranks agree with one rank running the whole batch)."""
        rank, size = self.data_parallel
        first = self.samples_seen * size + rank * batch
        if self.counting:  # not while a pipeline stage infers shapes on stand-in tensors
            self.samples_seen += batch
        return torch.arange(first, first + batch, device=device)

    def trunk(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
              document_ids: torch.Tensor | None = None, sample_ids: torch.Tensor | None = None):
        """(the last block's hidden states, the RoPE angles used, the documents' mask)."""
        batch, seq = tokens.shape[:2]
        documents, position_ids = self.packed_documents(position_ids, cache, document_ids)
        start = cache.length if cache is not None else 0
        if position_ids is None and start + seq > self.config.max_seq_len:
            raise DtmegaError(f"{start + seq} positions, but the model has {self.config.max_seq_len} (the config's "
                              f"max_seq_len). Fix: a shorter sequence, or a model with max_seq_len >= {start + seq}")
        positions = position_ids if position_ids is not None else torch.arange(start, start + seq,
                                                                                device=tokens.device)[None]
        rope = self.rope_cache[positions] if self.config.position_embedding == "rope" else None
        keys = None
        if self._dropping():
            ids = sample_ids if sample_ids is not None else self._sample_ids(batch, tokens.device)
            keys = token_keys(self.dropout_seed, ids, positions).expand(batch, seq)
        if self.embedding is not None:
            h = self.embedding(tokens, positions, keys)
        else:
            h = tokens
        for name, block in self.layers.items():
            h = block(h, rope, cache=cache.layer(name) if cache is not None else None, documents=documents, keys=keys)
        if cache is not None:
            cache.advance(seq)
        return h, rope, documents

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                document_ids: torch.Tensor | None = None, sample_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, vocab] (Decoder.forward), `sample_ids` [B]: the rows' global sample indices
        for dropout (default: counted; see `_sample_ids`)."""
        h, _, _ = self.trunk(tokens, position_ids, cache, document_ids, sample_ids)
        return self.head(h)

    def init_spec(self, name: str, param: nn.Parameter) -> InitSpec:
        """Megatron's scheme: N(0, std) for weights, each block's output projections scaled by
        1/sqrt(2 * n_layers), biases zero, norm weights one (zero when stored as 1 + w)."""
        std = self.config.init_std
        if name == "output.weight" and self.config.tie_embeddings:  # the last pipeline stage's copy of the tied embedding
            return InitSpec("normal", std, key="embedding.word.weight")
        if name.endswith(".bias"):
            return InitSpec("zeros")
        if param.ndim == 1:
            return InitSpec("zeros" if self.config.layernorm_1p else "ones")
        if name.endswith(("attention.wo.weight", "w2.weight", "experts.w2")):
            return InitSpec("normal", std / math.sqrt(2 * self.config.n_layers))
        return InitSpec("normal", std)

    def _tie(self) -> None:
        if self.config.tie_embeddings and self.output is not None and self.embedding is not None:
            self.output.weight = self.embedding.word.weight  # to_empty() unties shared parameters
