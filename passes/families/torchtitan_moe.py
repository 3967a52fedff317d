"""torchtitan's mixture-of-experts decoders (qwen3 MoE, and others built from torchtitan's
common `MoE` module), parallelized unchanged: expert parallelism swaps the token dispatcher
each `RoutedExperts` already calls, and shards its `GroupedExperts` weights."""

from __future__ import annotations

import torch
from torch import nn

from dtmega.kernels.document_attention import DocumentAttentionCore
from dtmega.passes.families.base import (
    ModelFacts,
    ModelFamily,
    MoEFacts,
    is_class,
    register_family,
)
from dtmega.passes.families.torchtitan_llama import _logits


def _moe_blocks(model: nn.Module) -> list[str]:
    return [name for name, block in model.layers.items() if getattr(block, "moe", None) is not None]


def _matches(model: nn.Module) -> bool:
    return (is_class(model, "torchtitan.models", "Decoder") and hasattr(model, "layers")
            and hasattr(model, "lm_head") and bool(_moe_blocks(model)))


def _describe(model: nn.Module) -> ModelFacts:
    config = model.config
    attention = config.first_attention
    moe_names = _moe_blocks(model)
    first_moe = model.layers[moe_names[0]].moe
    dense = [block for name, block in model.layers.items() if name not in moe_names]
    return ModelFacts(
        family="torchtitan-moe",
        n_heads=attention.n_heads,
        n_kv_heads=attention.n_kv_heads or attention.n_heads,
        vocab_size=config.vocab_size,
        dim=config.dim,
        ffn_dim=dense[0].feed_forward.w1.out_features if dense else first_moe.routed_experts.inner_experts.w1_EFD.shape[1],
        blocks=tuple(f"layers.{name}" for name in model.layers),
        embedding="tok_embeddings",
        output="lm_head",
        final_norm="norm",
        tied_embeddings=bool(config.enable_weight_tying),
        moe=MoEFacts(
            layers=tuple(f"layers.{name}.moe" for name in moe_names),
            num_experts=first_moe.router.num_experts,
            top_k=first_moe.router.top_k,
            router="router",
            experts="routed_experts.inner_experts",
            expert_params=("w1_EFD", "w2_EDF", "w3_EFD"),
            shared_experts="shared_experts" if first_moe.shared_experts is not None else None,
        ),
    )


class TorchtitanDispatcher:
    """torchtitan's token-dispatcher interface (dispatch/combine) over a dtmega dispatcher."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher

    def wire_meshes(self, *, ep_mesh) -> None:
        """torchtitan's own parallelization hook; the pass has wired the group already."""

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        rows, counts, state = self.dispatcher.dispatch(x_TD, topk_expert_ids_TK, None)
        return rows, counts, (state, topk_scores_TK)

    def combine(self, routed_output_RD, metadata, x_TD) -> torch.Tensor:
        state, scores = metadata
        return self.dispatcher.combine(routed_output_RD, scores, state).to(x_TD.dtype)


def _install_dispatcher(moe: nn.Module, dispatcher) -> None:
    moe.routed_experts.token_dispatcher = TorchtitanDispatcher(dispatcher)


TORCHTITAN_MOE = register_family(
    ModelFamily(
        name="torchtitan-moe",
        matches=_matches,
        describe=_describe,
        tp_rules=(),
        sp_rules=(),
        logits=_logits,
        attention_core="attention.inner_attention",
        position_kwarg="positions",
        document_kwarg="attention_masks",
        document_core=DocumentAttentionCore,
        install_dispatcher=_install_dispatcher,
    )
)
