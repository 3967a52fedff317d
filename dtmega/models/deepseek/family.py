"""dtmega's DeepSeek-V3 as a model family: its rule sets and shape facts.

Tensor parallelism splits MLA by heads: the per-head up-projections (`wq_b` or `wq`, `wkv_b`)
column-wise, the output projection row-wise; the latent down-projections (`wq_a`, `wkv_a`) and
their norms stay whole on every rank, as Megatron-Core's MLA does, and the rotary key every
head reads has its per-rank partial gradients summed (`rotary_key`, tp_style.py). The mixture of experts is
the Llama family's (experts on their hidden dim under TP, the router replicated); expert,
context and pipeline parallelism, recompute and document masking reach the blocks by the same
names as in the Llama.
"""

from __future__ import annotations

import torch
from torch import nn

import dtmega.models.deepseek.tp_style  # noqa: F401  (registers the "shared_across_heads" style)
from dtmega.models.deepseek.model import DeepSeek
from dtmega.models.llama.family import _install_dispatcher, _runtime_hooks
from dtmega.models.moe import moe_layers
from dtmega.passes.families import ModelFacts, ModelFamily, MoEFacts
from dtmega.passes.families.base import LatentAttentionFacts
from dtmega.passes.fusion_sites import slot_sites
from dtmega.passes.rules import Rule


def _describe(model: DeepSeek) -> ModelFacts:
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
        family="dtmega-deepseek", n_heads=c.n_heads, n_kv_heads=c.n_heads, vocab_size=c.vocab_size, dim=c.dim,
        ffn_dim=c.ffn_dim, blocks=tuple(f"layers.{name}" for name in model.layers), embedding="tok_embeddings",
        output="output", final_norm="norm", tied_embeddings=c.tie_embeddings, moe=moe, max_positions=c.max_seq_len,
        head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim,
        latent_attention=LatentAttentionFacts(c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
                                              c.v_head_dim),
        mtp_layers=len(model.mtp) if model.mtp is not None else 0,
        head_modules=("mtp",) if model.mtp is not None else (),
        head_blocks=tuple(f"mtp.{i}.block" for i in range(len(model.mtp))) if model.mtp is not None else (),
    )


def _logits(model: nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor | None,
            document_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
            loss_mask: torch.Tensor | None = None, **mtp_inputs: torch.Tensor) -> torch.Tensor:
    return model(tokens, position_ids, document_ids=document_ids, labels=labels, loss_mask=loss_mask, **mtp_inputs)


def _mtp_inputs(batch) -> dict:
    from dtmega.models.deepseek.mtp_runtime import mtp_inputs

    return mtp_inputs(batch)


# A block's rules (the trunk's `layers.*`), for the multi-token-prediction blocks `mtp.*.block` too
BLOCK_TP_RULES = (
    Rule("attention.wq", "colwise"),
    Rule("attention.wq_b", "colwise"),
    Rule("attention.wkv_b", "colwise"),
    Rule("attention.wo", "rowwise"),
    Rule("attention.rotary_key", "shared_across_heads"),
    # the latents: computed whole on every rank, before the heads are split
    Rule("attention.wq_a", "replicate"),
    Rule("attention.q_norm", "replicate"),
    Rule("attention.wkv_a", "replicate"),
    Rule("attention.kv_norm", "replicate"),
    Rule("feed_forward.w1", "colwise"),
    Rule("feed_forward.w3", "colwise"),
    Rule("feed_forward.w2", "rowwise"),
    Rule("feed_forward", "moe", module_type="MoE"),
    Rule("feed_forward.experts", "expert_hidden", module_type="GroupedExperts"),
    Rule("feed_forward.router.gate", "replicate"),  # sees every token, whole
    Rule("feed_forward.shared_experts.w1", "colwise"),
    Rule("feed_forward.shared_experts.w3", "colwise"),
    Rule("feed_forward.shared_experts.w2", "rowwise"),
)
BLOCK_SP_RULES = (
    Rule("attention_norm", "sequence_norm"),
    Rule("ffn_norm", "sequence_norm"),
    Rule("attention", "gather_input", options={"args": 2}),
    Rule("feed_forward", "gather_input", module_type="FeedForward", options={"args": 1}),
)
BLOCKS = ("layers.*", "mtp.*.block")


def _for_blocks(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    return tuple(Rule(f"{block}.{rule.pattern}", rule.style, module_type=rule.module_type, options=rule.options)
                 for block in BLOCKS for rule in rules)


def _fusion_sites(model: DeepSeek) -> dict[str, list[str]]:
    """Every norm (MLA's latent norms and the multi-token-prediction module's included), rotary
    and SwiGLU slot; each block's ffn_norm takes the residual add with it. The routed experts keep
    their grouped GEMMs."""
    depths = len(model.mtp) if model.mtp is not None else 0
    blocks = [f"layers.{name}" for name in model.layers] + [f"mtp.{i}.block" for i in range(depths)]
    return slot_sites(model, [f"{block}.ffn_norm" for block in blocks])


def _hooks(program) -> list:
    from dtmega.models.deepseek.mtp_runtime import mtp_hooks

    return _runtime_hooks(program) + mtp_hooks(program)


DTMEGA_DEEPSEEK = ModelFamily(
    name="dtmega-deepseek",
    matches=lambda model: isinstance(model, DeepSeek),
    describe=_describe,
    tp_rules=(
        Rule("tok_embeddings", "embedding"),
        *_for_blocks(BLOCK_TP_RULES),
        Rule("output", "output"),
    ),
    sp_rules=(
        *_for_blocks(BLOCK_SP_RULES),
        Rule("norm", "sequence_norm"),
        # multi-token prediction's per-position pieces: their weights whole, positions sharded
        Rule("mtp.*.enorm", "sequence_norm"),
        Rule("mtp.*.hnorm", "sequence_norm"),
        Rule("mtp.*.eh_proj", "sequence_norm"),
        Rule("mtp.*.norm", "sequence_norm"),
    ),
    logits=_logits,
    attention_core="attention.core",
    document_kwarg="document_ids",
    install_dispatcher=_install_dispatcher,
    moe_tensor_parallel=True,
    runtime_hooks=_hooks,
    loss_inputs=True,
    model_inputs=_mtp_inputs,
    fusion_sites=_fusion_sites,
)
