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

from dtmega.kernels.cross_entropy import cross_entropy_context, per_token_cross_entropy
from dtmega.models.decoder import Decoder
from dtmega.models.deepseek.config import DeepSeekConfig
from dtmega.models.deepseek.rope import deepseek_rope_cache
from dtmega.models.kv_cache import KVCache, LayerCache
from dtmega.models.llama.model import CoreAttention, TransformerBlock
from dtmega.models.moe import _AttachLoss
from dtmega.models.slots import RMSNorm, Rotary
from dtmega.passes.hidden_out import returns_logits


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
            self.q_norm = RMSNorm(c.q_lora_rank, eps=c.norm_eps)
            self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(c.dim, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(c.kv_lora_rank, eps=c.norm_eps)
        self.wkv_b = nn.Linear(c.kv_lora_rank, c.n_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.wo = nn.Linear(c.n_heads * c.v_head_dim, c.dim, bias=False)
        self.rotary = Rotary()  # RoPE on the queries' rotary channels [B, S, H, rope] and the one rotary key
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
        latent, k_rot = self.wkv_a(x).split([self.latent, self.rope], dim=-1)
        latent = self.kv_norm(latent)
        q_rot, k_rot = self.rotary(q_rot, k_rot.unsqueeze(2), rope)
        k_rot = self.rotary_key(k_rot)
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


class DeepSeekBlock(TransformerBlock):
    """The Llama's pre-norm residual block with MLA for attention, then a dense SwiGLU (the first
    blocks) or the MoE."""

    attention_class = MultiLatentAttention


class MultiTokenPrediction(nn.Module):
    """One depth of multi-token prediction (DeepSeek-V3; Megatron's MTP layer): the previous
    depth's hidden states and the embedding of the token `depth` places ahead, each
    RMS-normalized and concatenated ([embedding; hidden], the order of DeepSeek's checkpoints
    and Megatron), projected back to `dim` and through one block (an MoE block where the
    model's last one is); `norm` then the model's shared output layer give the logits of the
    token one place further still."""

    def __init__(self, config: DeepSeekConfig):
        super().__init__()
        self.enorm = RMSNorm(config.dim, eps=config.norm_eps)
        self.hnorm = RMSNorm(config.dim, eps=config.norm_eps)
        self.eh_proj = nn.Linear(2 * config.dim, config.dim, bias=False)
        self.block = DeepSeekBlock(config, config.n_layers)
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)

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
    Generation never runs the MTP modules.

    The rolled inputs (`mtp_tokens`, `mtp_labels`, `mtp_mask`: [B, S, depths], depth k's
    tokens, labels and mask moved k places left) may come with the batch, rolled over the
    whole sequence before context parallelism cut it (the MTP run-time hook does); without them
    they are rolled here. Under pipeline parallelism the first stage embeds the rolled tokens
    and the embeddings travel with the hidden states ([B, S, (1 + depths) x dim]) to the last
    stage, where the MTP modules live: the embedding stays one module on the first stage, and
    their gradient flows back through the pipeline like the hidden states'."""

    def __init__(self, config: DeepSeekConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): DeepSeekBlock(config, i) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.mtp = nn.ModuleList(MultiTokenPrediction(config) for _ in range(config.mtp_num_layers)) \
            if config.mtp_num_layers else None
        self.mtp_scales: list[torch.Tensor | float] | None = None
        self.mtp_stats: dict[str, torch.Tensor] = {}
        self.counting = True  # records mtp_stats (off for a pipeline's shape inference)
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)

    def _rope_cache(self, device=None) -> torch.Tensor:
        c = self.config
        return deepseek_rope_cache(c.max_seq_len, c.qk_rope_head_dim, c.rope_theta, c.yarn, device=device)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                document_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None, mtp_tokens: torch.Tensor | None = None,
                mtp_labels: torch.Tensor | None = None, mtp_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, vocab] (Decoder.forward); with `labels` (and `loss_mask`) while
        training, the multi-token-prediction loss rides on them (see the class docstring)."""
        depths = self.config.mtp_num_layers
        carried = None
        if self.tok_embeddings is None and depths and tokens.shape[-1] == (1 + depths) * self.config.dim:
            tokens, carried = tokens.split([self.config.dim, depths * self.config.dim], dim=-1)
        elif self.tok_embeddings is not None and self.output is None and depths and mtp_tokens is not None:
            carried = torch.cat([_local(self.tok_embeddings(mtp_tokens[..., d])) for d in range(depths)], dim=-1)
        h, rope, documents = self.trunk(tokens, position_ids, cache, document_ids)
        if self.output is None:  # a pipeline stage before the last: the embeddings ride along
            h = self.head(h)
            return h if carried is None else torch.cat([_local(h), _local(carried)], dim=-1)
        logits = self.head(h)
        if self.mtp is not None and labels is not None and self.training and torch.is_grad_enabled():
            inputs = _RolledInputs.of(tokens if carried is None else None, labels, loss_mask, depths, mtp_tokens,
                                      mtp_labels, mtp_mask)
            embedded = carried.chunk(depths, dim=-1) if carried is not None else [
                self.tok_embeddings(inputs.tokens[..., d]) for d in range(depths)]
            logits = _AttachLoss.apply(logits, self._mtp_loss(h, embedded, rope, documents, inputs), 1.0)
        return logits

    def _mtp_loss(self, h, embedded, rope, documents, inputs: "_RolledInputs") -> torch.Tensor:
        factor = self.config.mtp_loss_scaling_factor / len(self.mtp)
        # not when full recompute reruns this in backward, nor in a pipeline's shape inference
        counting = self.counting and torch._C._current_graph_task_id() == -1
        total = torch.zeros((), device=inputs.labels.device)
        for depth, module in enumerate(self.mtp, start=1):
            h = module(h, embedded[depth - 1], rope, documents)
            with returns_logits(self.output):  # a fused loss's output layer hands hidden states on otherwise
                logits = self.output(module.norm(h))
            with cross_entropy_context(logits):
                losses = per_token_cross_entropy(logits, inputs.labels[..., depth - 1])
            kept = inputs.mask[..., depth - 1]
            summed = (losses * kept).sum()
            if counting:
                for key, value in ((f"sum{depth}", summed.detach()), (f"count{depth}", kept.sum())):
                    self.mtp_stats[key] = self.mtp_stats.get(key, 0.0) + value
            scale = self.mtp_scales[depth - 1] if self.mtp_scales is not None else factor / kept.sum().clamp(min=1.0)
            total = total + summed.float() * scale
        return total


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what crosses a pipeline-stage boundary), a tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _RolledInputs:
    """Each MTP depth's tokens, labels and loss mask ([B, S, depths]): as the batch brought
    them (rolled over the whole sequence), or rolled here."""

    def __init__(self, tokens, labels, mask):
        self.tokens, self.labels, self.mask = tokens, labels, mask

    @classmethod
    def of(cls, tokens, labels, loss_mask, depths, mtp_tokens, mtp_labels, mtp_mask) -> "_RolledInputs":
        if mtp_labels is not None:
            return cls(mtp_tokens, mtp_labels, mtp_mask.float())
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
        return cls(*(torch.stack([roll_left(t, d) for d in range(1, depths + 1)], dim=-1) if t is not None else None
                     for t in (tokens, labels, mask)))
