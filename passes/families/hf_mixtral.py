"""Hugging Face `transformers.MixtralForCausalLM`, parallelized unchanged: expert parallelism
registers an experts implementation (transformers' `ExpertsInterface`) that dispatches the
routed tokens and runs the local experts as one grouped GEMM."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtmega.kernels.grouped_gemm import grouped_mm
from dtmega.passes.families.base import (
    ModelFacts,
    ModelFamily,
    MoEFacts,
    is_class,
    register_family,
)
from dtmega.passes.families.hf_llama import _logits, describe_hf_decoder

IMPLEMENTATION = "dtmega_expert_parallel"


def _matches(model: nn.Module) -> bool:
    return is_class(model, "transformers", "MixtralForCausalLM")


def _describe(model: nn.Module) -> ModelFacts:
    config = model.config
    return dataclasses.replace(describe_hf_decoder(model), family="hf-mixtral", moe=MoEFacts(
        layers=tuple(f"model.layers.{i}.mlp" for i in range(len(model.model.layers))),
        num_experts=config.num_local_experts, top_k=config.num_experts_per_tok, router="gate", experts="experts",
        expert_params=("gate_up_proj", "down_proj"),
    ))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def dispatched_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """MixtralExperts' forward with the tokens dispatched to the ranks holding their experts."""
    dispatcher = self.dtmega_dispatcher
    rows, counts, state = dispatcher.dispatch(hidden_states, top_k_index, None)
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
    gate, up = grouped_mm(rows, gate_up, counts).chunk(2, dim=-1)
    out = grouped_mm(self.act_fn(gate) * up, down, counts)
    return dispatcher.combine(out, top_k_weights, state).to(hidden_states.dtype)


def _install_dispatcher(moe: nn.Module, dispatcher) -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, dispatched_experts_forward)
    moe.experts.dtmega_dispatcher = dispatcher
    moe.experts.config._experts_implementation = IMPLEMENTATION


HF_MIXTRAL = register_family(
    ModelFamily(
        name="hf-mixtral",
        matches=_matches,
        describe=_describe,
        tp_rules=(),
        sp_rules=(),
        logits=_logits,
        install_dispatcher=_install_dispatcher,
    )
)
