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
            for module in program.modules_at(fqn):
                if entry.recompute == "full":
                    checkpoint(module)  # composable: FSDP's hooks re-gather the block's weights in recompute
                elif entry.recompute == "selective" and entry.kernel == "attention.recomputed":
                    module.forward = ATTENTION_CORES[_core_key(module)](module)
                elif entry.recompute == "selective":
                    checkpoint_forward(module)  # another core (e.g. context-parallel attention)


def _torchtitan_sdpa(module: nn.Module):
    forward = module.forward

    def recomputed(q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, is_causal=True, **kwargs):
        if attention_masks is not None or kwargs or not torch.is_grad_enabled():
            return forward(q, k, v, attention_masks=attention_masks, scale=scale, enable_gqa=enable_gqa,
                           is_causal=is_causal, **kwargs)
        out = recomputed_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=is_causal,
                                   scale=scale)
        return out.transpose(1, 2)

    return recomputed


# Attention cores whose computation is plain (causal or full) softmax attention: their forward
# becomes the recomputed-attention op, which works eagerly and inside compiled blocks alike.
ATTENTION_CORES = {
    ("torchtitan.models.common.attention", "ScaledDotProductAttention"): _torchtitan_sdpa,
}


def register_attention_core(module: str, class_name: str, make: Callable[[nn.Module], Callable]) -> None:
    """Makes selective recompute turn the attention core `module.class_name` into the
    recomputed-attention op: `make(core)` returns its new forward (a family registers its own)."""
    ATTENTION_CORES[(module, class_name)] = make


def _core_key(module: nn.Module) -> tuple[str, str]:
    return type(module).__module__, type(module).__name__


def checkpoint_forward(module: nn.Module) -> None:
    """Recomputes `module`'s forward in backward by running it under `torch.utils.checkpoint`
    (non-reentrant), outside any compiled graph.

    Two torch 2.13 failures shape this. The composable `checkpoint` (hooks around the module)
    inside a compiled block recomputed the attention core eagerly against tensors the compiled
    graph had saved in another shape (GQA keys expanded): "Recomputed values ... have different
    metadata". Traced into the block as an activation-checkpoint region instead, AOT autograd's
    partitioner saved a DeviceMesh as an activation under tensor parallelism ("expected all
    tensors_saved_with_vc_check to be Tensors"). So the region is excluded from compilation: a
    compiled block runs as graph, attention core (eager, recomputed), graph. The core is one
    SDPA call that compilation could not fuse further, and it holds no parameters, so no
    data-parallel hook needs to run inside the region."""
    forward = module.forward

    @torch.compiler.disable
    def recomputed_forward(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = recomputed_forward
