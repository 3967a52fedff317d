"""Compilation as a plan decision: `Compile(backend="inductor")` compiles every block.

The layout records it on each block (`compiled`), so the report shows what will run compiled
before anything runs; `ParallelModel.compile()` is a shortcut that runs this pass on an
already parallelized model.

Blocks, not the whole model: on torch 2.13 Dynamo/AOT autograd fail on the whole
tensor-parallel model for some shapes ("Mixing fake modes" at the vocab-parallel embedding,
invalid tangents in backward), while per-block graphs are stable (torchtitan compiles blocks
too). For the same reason tensor parallelism needs SequenceParallel here: compiled TP blocks
with replicated activations crash in backward for some shapes. Shapes are static unless
`dynamic` is given (training shapes are fixed), except in MoE models, where Dynamo's automatic
dynamic shapes cover the changing number of tokens per expert.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.program import Program
from dtmega.passes.results import Compilation
from dtmega.passes.tp_styles import STYLES

BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")


@dataclass
class Compile(Pass):
    """`torch.compile` of every transformer block in place (parameter names unchanged)."""

    backend: str = "inductor"
    blocks: str | None = None
    dynamic: bool | None = None

    after = ("*",)  # compiles what the other passes built

    def annotate(self, program: Program) -> None:
        if self.backend not in BACKENDS:
            raise PlanError(f"Compile(backend={self.backend!r}) is unknown; use one of {BACKENDS}")
        styles = [entry.style for entry in program.layout.modules.values()]
        has_tp = any(s in STYLES and STYLES[s].owner == "tensor_parallel" for s in styles)
        if has_tp and "sequence_norm" not in styles:
            raise PlanError(
                "compiling a tensor-parallel model needs SequenceParallel in the plan: on torch 2.13 compiled TP "
                "blocks with replicated activations crash in backward for some shapes. Fix: add SequenceParallel() "
                "after TensorParallel(), or run without compile"
            )
        blocks = program.blocks(self.blocks)
        for fqn in blocks:
            program.layout[fqn].compiled = self.backend
        dynamic = self.dynamic
        if dynamic is None and program.family is not None and program.facts.moe is None:
            dynamic = False
        program.record(Compilation(self.backend, tuple(blocks), dynamic))
        program.note(f"Compile({self.backend}): {len(blocks)} blocks")

    def apply(self, program: Program) -> None:
        compilation = program.require(Compilation, "Compile.apply")
        for fqn in compilation.blocks:
            for module in program.modules_at(fqn):
                module.compile(backend=compilation.backend, dynamic=compilation.dynamic)
