"""Activation recompute (Megatron's --recompute-granularity full|selective) as a pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.utils.checkpoint
from torch import nn
from torch.distributed._composable import checkpoint

from dtmega.kernels.recomputed_attention import recomputed_attention
from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.program import Program
from dtmega.passes.slots import swap_module


@dataclass
class Recompute(Pass):
    """Recomputes activations in backward instead of storing them.

    policy="full": the whole block is recomputed (only its input is kept).
    policy="selective": only the attention core is recomputed (Megatron's selective recompute);
    the model's family names its attention-core module.
    every=N: on blocks N-1, 2N-1, ... (every N-th block; every=1 means all blocks).
    first=N: only on the first N blocks (Megatron's --recompute-method block).
    `blocks` (a glob such as "layers.*") overrides the family's list of blocks.
    """

    policy: str = "full"
    every: int = 1
    first: int | None = None
    blocks: str | None = None

    provides = ("recompute",)
    # Selective recompute wraps the attention core, which context parallelism replaces.
    after = ("context_parallel@*",)

    def annotate(self, program: Program) -> None:
        if self.policy not in ("full", "selective"):
            raise PlanError(f"Recompute(policy={self.policy!r}) is unknown; use 'full' or 'selective'")
        if not isinstance(self.every, int) or self.every < 1:
            raise PlanError(f"Recompute(every={self.every!r}) must be a positive integer (1 = every block)")
        if self.first is not None and (not isinstance(self.first, int) or self.first < 1):
            raise PlanError(f"Recompute(first={self.first!r}) must be a positive integer")
        blocks = program.blocks(self.blocks)
        chosen = [fqn for i, fqn in enumerate(blocks) if (i + 1) % self.every == 0]
        if self.first is not None:
            chosen = [fqn for fqn in chosen if blocks.index(fqn) < self.first]
        if not chosen:
            raise PlanError(
                f"Recompute(every={self.every}) selects none of the {len(blocks)} blocks; "
                f"use every <= {len(blocks)}"
            )
        for fqn in chosen:
            target = self._target(program, fqn)
            entry = program.layout[target]
            entry.recompute = self.policy
            module = program.modules[target]
            if self.policy == "selective" and entry.kernel is None and _core_key(module) in ATTENTION_CORES:
                entry.kernel = "attention.recomputed"  # the op that saves only q, k, v
        program.note(f"Recompute({self.policy}): {len(chosen)} of {len(blocks)} blocks")

    def _target(self, program: Program, block: str) -> str:
        if self.policy == "full":
            return block
        core = program.family.attention_core if program.family else None
        if core is None:
            raise PlanError(
                f"Recompute(policy='selective') recomputes the attention core, but "
                f"{type(program.model).__name__} computes attention in a function, not a module "
                "the pass can wrap. Fix: use policy='full'"
            )
        target = f"{block}.{core}"
        if target not in program.layout:
            raise PlanError(f"selective recompute expected an attention core at {target!r}; none found")
        return target

    def apply(self, program: Program) -> None:
        for fqn, entry in program.layout.modules.items():
            if entry.recompute == "full":
                for module in program.modules_at(fqn):
                    checkpoint(module)  # composable: FSDP's hooks re-gather the block's weights in recompute
            elif entry.recompute == "selective":
                # the core's slot takes a module that recomputes it: the recomputed-attention op where
                # the core is plain softmax attention, else the core itself under checkpoint (e.g.
                # context-parallel attention)
                recomputed = entry.kernel == "attention.recomputed"
                swap_module(program, fqn, lambda core: ATTENTION_CORES[_core_key(core)](core) if recomputed
                            else CheckpointedCore(core), "Recompute(selective)")


class RecomputedSDPA(nn.Module):
    """torchtitan's ScaledDotProductAttention core as the recomputed-attention op (only q, k, v
    saved); masked, keyword-laden or gradient-free calls go to the core itself."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, is_causal=True, **kwargs):
        if attention_masks is not None or kwargs or not torch.is_grad_enabled():
            return self.inner(q, k, v, attention_masks=attention_masks, scale=scale, enable_gqa=enable_gqa,
                              is_causal=is_causal, **kwargs)
        out = recomputed_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=is_causal,
                                   scale=scale)
        return out.transpose(1, 2)


# Attention cores whose computation is plain (causal or full) softmax attention: the module that
# runs them as the recomputed-attention op, which works eagerly and inside compiled blocks alike.
ATTENTION_CORES: dict[tuple[str, str], Callable[[nn.Module], nn.Module]] = {
    ("torchtitan.models.common.attention", "ScaledDotProductAttention"): RecomputedSDPA,
}


def register_attention_core(module: str, class_name: str, make: Callable[[nn.Module], nn.Module]) -> None:
    """Makes selective recompute put the recomputed-attention op in the slot of the attention core
    `module.class_name`: `make(core)` returns the module that does it (holding the core for the
    calls it does not recompute; a family registers its own)."""
    ATTENTION_CORES[(module, class_name)] = make


def _core_key(module: nn.Module) -> tuple[str, str]:
    return type(module).__module__, type(module).__name__


class CheckpointedCore(nn.Module):
    """A core recomputed in backward under `torch.utils.checkpoint` (non-reentrant), outside any
    compiled graph.

    Two torch 2.13 failures shape this. The composable `checkpoint` (hooks around the module)
    inside a compiled block recomputed the attention core eagerly against tensors the compiled
    graph had saved in another shape (GQA keys expanded): "Recomputed values ... have different
    metadata". Traced into the block as an activation-checkpoint region instead, AOT autograd's
    partitioner saved a DeviceMesh as an activation under tensor parallelism ("expected all
    tensors_saved_with_vc_check to be Tensors"). So the region is excluded from compilation: a
    compiled block runs as graph, attention core (eager, recomputed), graph. The core is one
    SDPA call that compilation could not fuse further, and it holds no parameters, so no
    data-parallel hook needs to run inside the region."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False, **kwargs)
