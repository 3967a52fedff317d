"""Activation recompute (Megatron's --recompute-granularity full|selective) as a pass."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed._composable import checkpoint

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
            program.layout[self._target(program, fqn)].recompute = self.policy
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
            if entry.recompute in ("full", "selective"):
                for module in program.modules_at(fqn):
                    checkpoint(module)
