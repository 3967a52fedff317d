"""dtmega's own Llama as a model family: its rule sets and shape facts."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtmega.kernels.recomputed_attention import recomputed_attention
from dtmega.models.llama.model import Llama
from dtmega.models.moe import MoE, moe_layers
from dtmega.passes.families import ModelFacts, ModelFamily, MoEFacts
from dtmega.passes.fusion_sites import slot_sites
from dtmega.passes.recompute import register_attention_core
from dtmega.passes.rules import Rule


class RecomputedCoreAttention(nn.Module):
    """dtmega's attention core as the recomputed-attention op (selective recompute: only q, k, v
    kept); packed documents recompute the masked core under checkpoint; decoding with a KV cache,
    or no gradient, runs the core itself."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, q, k, v, q_offset: int | torch.Tensor = 0, documents=None):
        if documents is not None:  # packed documents: the masked attention recomputed in backward
            return _checkpointed_documents(self.inner, q, k, v, documents)
        if isinstance(q_offset, torch.Tensor) or q_offset or not torch.is_grad_enabled():
            return self.inner(q, k, v, q_offset=q_offset)
        width = v.shape[-1]
        if width != q.shape[-1]:  # MLA's narrower values: zero-padded to the fused kernel's one head size
            v = torch.nn.functional.pad(v, (0, q.shape[-1] - width))
        out = recomputed_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        return out[..., :width]


@torch.compiler.disable
def _checkpointed_documents(core, q, k, v, documents):
    """The document-masked attention core under torch.utils.checkpoint: only q, k, v (and the
    mask) kept; outside any compiled graph, as passes/recompute.py's CheckpointedCore explains."""
    if not torch.is_grad_enabled():
        return core(q, k, v, documents=documents)
    return checkpoint(core, q, k, v, documents=documents, use_reentrant=False)


def _describe(model: Llama, family: str = "dtmega-llama") -> ModelFacts:
    c = model.config
    layers = tuple(name for name, _ in moe_layers(model))
    moe = None
    if layers:
        moe = MoEFacts(
            layers=layers, num_experts=c.moe.num_experts, top_k=c.moe.top_k, router="router", experts="experts",
            expert_params=("w1", "w2", "w3"), shared_experts="shared_experts" if c.moe.shared_expert_ffn_dim else None,
            capacity_factor=c.moe.capacity_factor, num_groups=c.moe.num_groups, group_topk=c.moe.group_topk,
        )
    return ModelFacts(
        family=family,
        n_heads=c.n_heads,
        head_dim=c.head_dim,
        n_kv_heads=c.n_kv_heads,
        vocab_size=c.vocab_size,
        dim=c.dim,
        ffn_dim=c.ffn_dim,
        blocks=tuple(f"layers.{name}" for name in model.layers),
        embedding="tok_embeddings",
        output="output",
        final_norm="norm",
        tied_embeddings=c.tie_embeddings,
        moe=moe,
        max_positions=c.max_seq_len,
    )


def _logits(model: nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor | None,
            document_ids: torch.Tensor | None = None) -> torch.Tensor:
    if document_ids is not None:
        return model(tokens, position_ids, document_ids=document_ids)
    return model(tokens, position_ids)


def _runtime_hooks(program) -> list:
    from dtmega.moe_runtime import moe_hooks

    return moe_hooks(program)


def _fusion_sites(model: Llama) -> dict[str, list[str]]:
    """Every norm, rotary and SwiGLU slot; each block's ffn_norm takes the residual add with it."""
    return slot_sites(model, [f"layers.{name}.ffn_norm" for name in model.layers])


def _install_dispatcher(moe: nn.Module, dispatcher) -> None:
    assert isinstance(moe, MoE)
    moe.dispatcher = dispatcher


def decoder_passes_family(name: str, model_class: type[Llama]) -> ModelFamily:
    """What the passes know of dtmega's Llama decoder and of a family built on it (Qwen3): its
    facts, TP/SP rules (the q/k-norm slots included), attention core, fusion sites and hooks."""
    return ModelFamily(
        name=name,
        matches=lambda model: isinstance(model, model_class),
        describe=lambda model: _describe(model, name),
        tp_rules=(
            Rule("tok_embeddings", "embedding"),
            Rule("layers.*.attention.wq", "colwise"),
            Rule("layers.*.attention.wk", "colwise"),
            Rule("layers.*.attention.wv", "colwise"),
            Rule("layers.*.attention.wo", "rowwise"),
            Rule("layers.*.attention.q_norm", "head_norm"),  # per-head norms on this rank's heads (qk_norm)
            Rule("layers.*.attention.k_norm", "head_norm"),
            Rule("layers.*.feed_forward.w1", "colwise"),
            Rule("layers.*.feed_forward.w3", "colwise"),
            Rule("layers.*.feed_forward.w2", "rowwise"),
            # Mixture-of-experts blocks: experts split on their hidden dim (Megatron's expert
            # tensor parallelism = TP), shared experts as a dense MLP, router replicated.
            Rule("layers.*.feed_forward", "moe", module_type="MoE"),
            Rule("layers.*.feed_forward.experts", "expert_hidden", module_type="GroupedExperts"),
            Rule("layers.*.feed_forward.router.gate", "replicate"),  # sees every token, whole
            Rule("layers.*.feed_forward.shared_experts.w1", "colwise"),
            Rule("layers.*.feed_forward.shared_experts.w3", "colwise"),
            Rule("layers.*.feed_forward.shared_experts.w2", "rowwise"),
            Rule("output", "output"),
        ),
        sp_rules=(
            Rule("layers.*.attention_norm", "sequence_norm"),
            Rule("layers.*.ffn_norm", "sequence_norm"),
            Rule("norm", "sequence_norm"),
            Rule("layers.*.attention", "gather_input", options={"args": 2}),
            Rule("layers.*.feed_forward", "gather_input", module_type="FeedForward", options={"args": 1}),
        ),
        logits=_logits,
        attention_core="attention.core",
        document_kwarg="document_ids",
        install_dispatcher=_install_dispatcher,
        moe_tensor_parallel=True,
        runtime_hooks=_runtime_hooks,
        fusion_sites=_fusion_sites,
    )


DTMEGA_LLAMA = decoder_passes_family("dtmega-llama", Llama)
register_attention_core("dtmega.models.llama.model", "CoreAttention", RecomputedCoreAttention)
