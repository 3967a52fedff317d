"""What the passes know of the GPT family: its shape facts, tensor/sequence-parallel rules (biases
shard with their weights: a column-wise layer's bias is split, a row-wise layer's is added once
after the reduction; learned positions and norms are whole on every rank), the attention core
and the fusion sites."""

from __future__ import annotations

import torch
from torch import nn

from dtmega.models.gpt.model import GPT
from dtmega.models.moe import MoE, moe_layers
from dtmega.passes.families import ModelFacts, ModelFamily, MoEFacts
from dtmega.passes.fusion_sites import slot_sites
from dtmega.passes.rules import Rule


def _describe(model: GPT) -> ModelFacts:
    c = model.config
    layers = tuple(name for name, _ in moe_layers(model))
    moe = None
    if layers:
        moe = MoEFacts(layers=layers, num_experts=c.moe.num_experts, top_k=c.moe.top_k, router="router",
                       experts="experts", expert_params=("w1", "w2", "w3") if c.moe.activation == "swiglu" else ("w1", "w2"),
                       shared_experts="shared_experts" if c.moe.shared_expert_ffn_dim else None,
                       capacity_factor=c.moe.capacity_factor, num_groups=c.moe.num_groups, group_topk=c.moe.group_topk)
    return ModelFacts(
        family="dtmega-gpt", n_heads=c.n_heads, head_dim=c.head_dim, n_kv_heads=c.kv_heads, vocab_size=c.vocab_size,
        dim=c.dim, ffn_dim=c.hidden_ffn, blocks=tuple(f"layers.{name}" for name in model.layers),
        embedding="embedding", output="output", final_norm="norm", tied_embeddings=c.tie_embeddings,
        max_positions=c.max_seq_len, moe=moe, gpt_block=c,
    )


def _logits(model: nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor | None,
            document_ids: torch.Tensor | None = None) -> torch.Tensor:
    if document_ids is not None:
        return model(tokens, position_ids, document_ids=document_ids)
    return model(tokens, position_ids)


def _runtime_hooks(program) -> list:
    from dtmega.moe_runtime import moe_hooks

    return moe_hooks(program)


def _install_dispatcher(moe: nn.Module, dispatcher) -> None:
    assert isinstance(moe, MoE)
    moe.dispatcher = dispatcher


def _fusion_sites(model: GPT) -> dict[str, list[str]]:
    """RMSNorm, RoPE and SwiGLU slots where the config has them (LayerNorm and GeLU run as torch's)."""
    return slot_sites(model, [f"layers.{name}.ffn_norm" for name in model.layers])


DTMEGA_GPT = ModelFamily(
    name="dtmega-gpt",
    matches=lambda model: isinstance(model, GPT),
    describe=_describe,
    tp_rules=(
        Rule("embedding.word", "embedding", options={"residual": False}),  # positions are added to its output
        Rule("embedding.position", "replicate"),  # positions whole on every rank, added after the reduction
        Rule("layers.*.attention.wq", "colwise"),
        Rule("layers.*.attention.wk", "colwise"),
        Rule("layers.*.attention.wv", "colwise"),
        Rule("layers.*.attention.wo", "rowwise"),
        Rule("layers.*.attention.q_norm", "head_norm"),  # per-head norms on this rank's heads (--qk-layernorm)
        Rule("layers.*.attention.k_norm", "head_norm"),
        Rule("layers.*.feed_forward.w1", "colwise"),
        Rule("layers.*.feed_forward.w3", "colwise"),
        Rule("layers.*.feed_forward.w2", "rowwise"),
        # mixture-of-experts blocks (--num-experts): experts split on their hidden dim (Megatron's
        # expert tensor parallelism = TP), shared experts as a dense MLP, the router whole
        Rule("layers.*.feed_forward", "moe", module_type="MoE"),
        Rule("layers.*.feed_forward.experts", "expert_hidden", module_type="GroupedExperts"),
        Rule("layers.*.feed_forward.router.gate", "replicate"),
        Rule("layers.*.feed_forward.shared_experts.w1", "colwise"),
        Rule("layers.*.feed_forward.shared_experts.w3", "colwise"),
        Rule("layers.*.feed_forward.shared_experts.w2", "rowwise"),
        Rule("output", "output"),
    ),
    sp_rules=(
        Rule("layers.*.attention_norm", "sequence_norm"),
        Rule("layers.*.ffn_norm", "sequence_norm"),
        Rule("norm", "sequence_norm"),
        # dropout of the residual branches on this rank's positions (keys sliced to them)
        Rule("layers.*.attention_dropout", "sequence_norm"),
        Rule("layers.*.mlp_dropout", "sequence_norm"),
        Rule("layers.*.attention", "gather_input", options={"args": 2}),
        Rule("layers.*.feed_forward", "gather_input", module_type="MLP", options={"args": 1}),
    ),
    logits=_logits,
    attention_core="attention.core",
    document_kwarg="document_ids",
    fusion_sites=_fusion_sites,
    install_dispatcher=_install_dispatcher,
    moe_tensor_parallel=True,
    runtime_hooks=_runtime_hooks,
)
