"""dtmega's DeepSeek-V3: multi-latent attention and DeepSeek's mixture of experts, plain and
unsharded like the Llama (models/llama/model.py), so every plan is checked against it.

Passes find the pieces by name: `layers.N.attention.{wq_a, wq_b | wq, wkv_a, wkv_b, wo}`, the
attention core `layers.N.attention.core` (the Llama's CoreAttention: context parallelism,
selective recompute and document masking reach it the same way), `layers.N.feed_forward` (a
dense SwiGLU or dtmega's MoE with DeepSeek-V3's router). Views use -1 for the head count, so the
same code runs on a tensor-parallel shard of the heads.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from dtmega.kernels.cross_entropy import per_token_cross_entropy
from dtmega.models.decoder import Decoder
from dtmega.models.deepseek.config import DeepSeekConfig
from dtmega.models.deepseek.rope import deepseek_rope_cache
from dtmega.models.feed_forward import FeedForward
from dtmega.models.kv_cache import KVCache, LayerCache
from dtmega.models.llama.model import CoreAttention
from dtmega.models.moe import MoE, _AttachLoss
from dtmega.models.rope import apply_rope


class SharedAcrossHeads(nn.Module):
    """Identity on a tensor every head reads (MLA's rotary key). Under tensor parallelism each
    rank holds some of the heads, so the tensor's gradient is one partial sum per rank: the
    family's TP rule sets `tp_mesh` (passes' "shared_across_heads" style) and the backward then
    sums it over the ranks. A module of its own so a rule can name it."""

    tp_mesh = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is None:
            return x
        return DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class MultiLatentAttention(nn.Module):
    """MLA: queries through an optional low-rank latent, keys and values from one shared
    latent (RMS-normalized) plus a single rotary key shared by every head.

    Decoding caches the normalized latent [B, S, kv_lora_rank] and the rotated key
    [B, S, 1, qk_rope_head_dim] only (`LayerCache`), and expands them to every head's keys and
    values when attending: the cache is (kv_lora_rank + qk_rope_head_dim) values per token and
    layer instead of heads x (qk_head_dim + v_head_dim)."""

    def __init__(self, config: DeepSeekConfig):
        super().__init__()
        c = config
        self.nope, self.rope, self.v_dim, self.latent = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        self.rope_factor = c.yarn.rope_factor if c.yarn else 1.0
        self.query_factor = c.yarn.softmax_factor if c.yarn else 1.0  # the core scales by 1/sqrt(qk_head_dim)
        if c.q_lora_rank is None:
            self.wq = nn.Linear(c.dim, c.n_heads * c.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(c.dim, c.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(c.q_lora_rank, eps=c.norm_eps)
            self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(c.dim, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(c.kv_lora_rank, eps=c.norm_eps)
        self.wkv_b = nn.Linear(c.kv_lora_rank, c.n_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.wo = nn.Linear(c.n_heads * c.v_head_dim, c.dim, bias=False)
        self.rotary_key = SharedAcrossHeads()
        self.core = CoreAttention()

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq"):
            return self.wq(x)
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None,
                documents=None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self._query(x).view(batch, seq, -1, self.nope + self.rope)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        q_rot = apply_rope(q_rot, rope)
        latent, k_rot = self.wkv_a(x).split([self.latent, self.rope], dim=-1)
        latent = self.kv_norm(latent)
        k_rot = self.rotary_key(apply_rope(k_rot.unsqueeze(2), rope))
        if self.rope_factor != 1.0:
            q_rot, k_rot = q_rot * self.rope_factor, k_rot * self.rope_factor
        offset = 0
        if cache is not None:
            offset = cache.owner.length
            latent, k_rot = cache.update(latent, k_rot)
        keys = latent.shape[1]
        kv = self.wkv_b(latent).view(batch, keys, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        if self.query_factor != 1.0:
            q = q * self.query_factor
        if documents is not None:
            out = self.core(q, k, v, documents=documents)
        elif cache is None:
            out = self.core(q, k, v)
        else:
            out = self.core(q, k, v, q_offset=offset)
        return self.wo(out.reshape(batch, seq, -1))


class DeepSeekBlock(nn.Module):
    """Pre-norm residual block: MLA, then a dense SwiGLU (the first blocks) or the MoE."""

    def __init__(self, config: DeepSeekConfig, index: int = 0):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = MultiLatentAttention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        if config.moe is not None and config.moe.is_moe_layer(index):
            self.feed_forward: nn.Module = MoE(config.dim, config.moe)
        else:
            self.feed_forward = FeedForward(config.dim, config.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None,
                documents=None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, cache=cache, documents=documents)
        return h + self.feed_forward(self.ffn_norm(h))


class MultiTokenPrediction(nn.Module):
    """One depth of multi-token prediction (DeepSeek-V3; Megatron's MTP layer): the previous
    depth's hidden states and the embedding of the token `depth` places ahead, each
    RMS-normalized and concatenated ([embedding; hidden], the order of DeepSeek's checkpoints
    and Megatron), projected back to `dim` and through one block (an MoE block where the
    model's last one is); `norm` then the model's shared output layer give the logits of the
    token one place further still."""

    def __init__(self, config: DeepSeekConfig):
        super().__init__()
        self.enorm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.hnorm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.eh_proj = nn.Linear(2 * config.dim, config.dim, bias=False)
        self.block = DeepSeekBlock(config, config.n_layers)
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope: torch.Tensor, documents=None) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.block(x, rope, documents=documents)


def roll_left(tensor: torch.Tensor, shift: int) -> torch.Tensor:
    """[B, S, ...] moved `shift` places towards the start along S, zeros coming in at the end
    (Megatron's roll of the MTP inputs, labels and loss mask)."""
    out = torch.zeros_like(tensor)
    out[:, :tensor.shape[1] - shift] = tensor[:, shift:]
    return out


class DeepSeek(Decoder):
    """DeepSeek-V3-style decoder (models/deepseek/config.py), with `mtp_num_layers` depths of
    multi-token prediction trained beside the next-token loss.

    Training (labels given, grad enabled, `train()` mode) adds depth k's loss, the cross
    entropy of predicting token i + k + 1 at position i over the positions the loss mask rolled
    left by k keeps, averaged over those positions and times mtp_loss_scaling_factor / depths;
    the loss is attached to the logits (its gradient flows in the same backward) and its value
    recorded in `mtp_stats`. `mtp_scales` (set per step by the MTP run-time hook) replaces
    each depth's local average by the whole global batch's, as the next-token loss is averaged.
    Generation never runs the MTP modules."""

    def __init__(self, config: DeepSeekConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): DeepSeekBlock(config, i) for i in range(config.n_layers)})
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.mtp = nn.ModuleList(MultiTokenPrediction(config) for _ in range(config.mtp_num_layers)) \
            if config.mtp_num_layers else None
        self.mtp_scales: list[torch.Tensor | float] | None = None
        self.mtp_stats: dict[str, torch.Tensor] = {}
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)

    def _rope_cache(self, device=None) -> torch.Tensor:
        c = self.config
        return deepseek_rope_cache(c.max_seq_len, c.qk_rope_head_dim, c.rope_theta, c.yarn, device=device)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                document_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, vocab] (Decoder.forward); with `labels` (and `loss_mask`) while
        training, the multi-token-prediction loss rides on them (see the class docstring)."""
        h, rope, documents = self.trunk(tokens, position_ids, cache, document_ids)
        logits = self.head(h)
        if self.mtp is not None and labels is not None and self.training and torch.is_grad_enabled():
            mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
            logits = _AttachLoss.apply(logits, self._mtp_loss(h, tokens, rope, documents, labels, mask), 1.0)
        return logits

    def _mtp_loss(self, h, tokens, rope, documents, labels, mask) -> torch.Tensor:
        factor = self.config.mtp_loss_scaling_factor / len(self.mtp)
        counting = torch._C._current_graph_task_id() == -1  # not when full recompute reruns this in backward
        total = torch.zeros((), device=h.device)
        for depth, module in enumerate(self.mtp, start=1):
            h = module(h, self.tok_embeddings(roll_left(tokens, depth)), rope, documents)
            losses = per_token_cross_entropy(self.output(module.norm(h)), roll_left(labels, depth))
            kept = roll_left(mask, depth)
            summed = (losses * kept).sum()
            if counting:
                for key, value in ((f"sum{depth}", summed.detach()), (f"count{depth}", kept.sum())):
                    self.mtp_stats[key] = self.mtp_stats.get(key, 0.0) + value
            scale = self.mtp_scales[depth - 1] if self.mtp_scales is not None else factor / kept.sum().clamp(min=1.0)
            total = total + summed.float() * scale
        return total

