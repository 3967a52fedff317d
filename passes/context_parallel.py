"""Context parallelism as a pass: the sequence is sharded over the `cp` axis and the model's
attention core is replaced by context-parallel attention (ring, all-gather or all-to-all).

Unlike torch's `context_parallel` (which patches SDPA globally and needs a GPU SDPA backend),
this rewrites the attention modules the layout names, and runs on gloo and nccl alike.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from dtmega.kernels.context_attention import METHODS, context_parallel_attention
from dtmega.kernels.context_shards import CommStats
from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.program import Program

LOAD_BALANCE = ("zigzag", None)
_HF_NAMES = itertools.count()


class ContextParallelAttention(nn.Module):
    """Drop-in attention core for [B, S, H, D] q/k/v sharded on S over `group`."""

    def __init__(self, group, method: str, zigzag: bool, stats: CommStats):
        super().__init__()
        self.group, self.method, self.zigzag, self.stats = group, method, zigzag, stats

    def forward(self, q, k, v, *args, scale=None, is_causal=True, attention_masks=None, q_offset=0, **kwargs):
        if attention_masks is not None:
            raise ValueError("context-parallel attention handles causal and full masks only, not attention_masks")
        if q_offset:
            raise ValueError("context-parallel attention does not decode with a KV cache; generate without CP")
        return context_parallel_attention(q, k, v, group=self.group, method=self.method, zigzag=self.zigzag,
                                          causal=is_causal, scale=scale, stats=self.stats)

    def extra_repr(self) -> str:
        return f"method={self.method}, zigzag={self.zigzag}"


def hf_attention_function(group, method: str, zigzag: bool, stats: CommStats):
    """A Hugging Face attention implementation ([B, H, S, D] in, [B, S, H, D] out)."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if dropout:
            raise ValueError("context-parallel attention does not support attention dropout")
        out = context_parallel_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), group=group, method=method,
            zigzag=zigzag, causal=getattr(module, "is_causal", True), scale=scaling, stats=stats,
        )
        return out, None

    return attention


@dataclass
class ContextParallel(Pass):
    """Shards the sequence over `axis` (zigzag: rank r holds chunks r and 2*cp-1-r of 2*cp, so
    causal work is balanced) and runs attention with `method` = ring | all_gather | a2a.
    Position ids stay global. Needs a DataParallel pass (gradients are averaged over dp x cp)."""

    axis: str = "cp"
    method: str = "ring"
    load_balance: str | None = "zigzag"

    provides = ("context_parallel@{axis}",)

    def annotate(self, program: Program) -> None:
        size = program.axis_size(self.axis)
        if self.method not in METHODS:
            raise PlanError(f"ContextParallel(method={self.method!r}) is unknown; use one of {METHODS}")
        if self.load_balance not in LOAD_BALANCE:
            raise PlanError(f"ContextParallel(load_balance={self.load_balance!r}); use 'zigzag' or None")
        family = program.family
        if family is None or (family.attention_core is None and not family.name.startswith("hf-")):
            raise PlanError(
                f"ContextParallel cannot find the attention of {type(program.model).__name__}: its model family "
                "names no attention-core module. Fix: register a family with attention_core, or drop ContextParallel"
            )
        facts = program.facts
        if size > 1 and facts.moe is not None and facts.moe.capacity_factor is not None:
            raise PlanError(
                f"the model's MoE layers drop tokens above capacity per sequence (capacity_factor="
                f"{facts.moe.capacity_factor}), which needs whole sequences on a rank, but ContextParallel splits "
                "them. Fix: dropless routing (capacity_factor=None) with context parallelism"
            )
        tp = program.state.get("tensor_parallel", {}).get("tp", 1)
        if self.method == "a2a" and (facts.n_heads // tp) % size:
            raise PlanError(
                f"ContextParallel(method='a2a') moves heads between ranks: {facts.n_heads // tp} heads per rank "
                f"are not divisible by cp={size}. Fix: method='ring' or 'all_gather', or another cp size"
            )
        targets = []
        if family.attention_core is not None:
            for block in facts.blocks:
                fqn = f"{block}.{family.attention_core}"
                inner = program.modules.get(fqn)
                if inner is None:
                    raise PlanError(f"ContextParallel expected an attention core at {fqn!r}; none found")
                kind = type(inner).__name__
                if kind in ("FlexAttention", "VarlenAttention"):
                    raise PlanError(
                        f"{fqn} is {kind}, whose block/document masks context parallelism cannot handle (it "
                        "handles causal and full masks). Fix: build the model with ScaledDotProductAttention"
                    )
                program.layout[fqn].kernel = f"context_parallel({self.method})"
                targets.append(fqn)
        else:
            implementation = getattr(program.model.config, "_attn_implementation", "sdpa")
            if implementation not in ("sdpa", "eager"):
                raise PlanError(f"ContextParallel replaces 'sdpa'/'eager' attention, not {implementation!r}")
            for block in facts.blocks:
                program.layout[block].kernel = f"context_parallel({self.method})"
        program.layout[""].inputs[self.axis] = "S(1)"  # tokens (and every activation) sharded on the sequence
        program.state["context_parallel"] = {
            "axis": self.axis, "size": size, "method": self.method, "zigzag": self.load_balance == "zigzag",
            "targets": targets,
        }
        program.note(f"ContextParallel({self.method}, cp={size}, load_balance={self.load_balance})")

    def finalize(self, program: Program) -> None:
        if program.axis_size(self.axis) > 1 and "data_parallel" not in program.state:
            raise PlanError(
                "ContextParallel splits every sequence over cp ranks, whose gradients must then be averaged: add "
                "DataParallel('ddp') (or 'fsdp') to the plan, after ContextParallel"
            )

    def apply(self, program: Program) -> None:
        info = program.state["context_parallel"]
        group = program.submesh(self.axis).get_group()
        stats = info.setdefault("stats", CommStats())
        zigzag = info["zigzag"]
        for fqn in info["targets"]:
            parent_fqn, _, name = fqn.rpartition(".")
            for parent in program.modules_at(parent_fqn):
                setattr(parent, name, ContextParallelAttention(group, self.method, zigzag, stats))
        if not info["targets"]:  # Hugging Face: a registered attention implementation
            from transformers import AttentionInterface

            key = f"dtmega_context_parallel_{next(_HF_NAMES)}"
            AttentionInterface.register(key, hf_attention_function(group, self.method, zigzag, stats))
            for part in program.parts:
                part.config._attn_implementation = key


def shard_sequence(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """This cp rank's columns of a [B, S, ...] tensor."""
    return tensor.index_select(1, index.to(tensor.device))
