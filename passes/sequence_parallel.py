"""Sequence parallelism (Megatron's SP): between tensor-parallel regions the residual stream,
norms included, is sharded on the sequence dim instead of replicated."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.placements import PARTIAL, REPLICATE
from dtmega.passes.program import Program
from dtmega.passes.rules import Rule, resolve_rules
from dtmega.passes.tp_styles import RESIDUAL_BLOCKS, RESIDUAL_READERS, RESIDUAL_WRITERS, SEQ, apply_styles, style


@dataclass
class SequenceParallel(Pass):
    """Turns the all-reduces at the end of TP regions into reduce-scatters onto the sequence
    dim, runs norms on sequence shards, and all-gathers at the start of the next TP region.

    Requires TensorParallel on the same axis (it reshapes what TP annotated).
    """

    axis: str = "tp"
    rules: list[Rule] = field(default_factory=list)
    builtin_rules: bool = True

    requires = ("tensor_parallel@{axis}",)
    provides = ("sequence_parallel@{axis}",)
    refines = ("tensor_parallel@{axis}",)  # turns its all-reduces into reduce-scatters, styles its norms

    def __post_init__(self) -> None:
        self.rules = [Rule.coerce(r) for r in self.rules]

    def mesh_axes(self) -> tuple[str, ...]:
        return ()  # the axis belongs to TensorParallel; SP changes how it is used

    def annotate(self, program: Program) -> None:
        program.axis_size(self.axis)
        defaults = list(program.family.sp_rules) if (program.family and self.builtin_rules) else []
        if not defaults and not self.rules:
            program.facts
            raise PlanError("SequenceParallel has no rules: pass rules=[Rule(pattern, style), ...]")
        blocks = [fqn for fqn, entry in program.layout.modules.items() if entry.style in RESIDUAL_BLOCKS]
        for fqn, entry in program.layout.modules.items():
            if any(fqn.startswith(f"{block}.") for block in blocks):
                continue  # inside a block that rejoins the residual stream itself (MoE shared experts)
            if (entry.style in RESIDUAL_WRITERS and entry.outputs.get(self.axis) == f"{PARTIAL}->{REPLICATE}"
                    and entry.options.get("residual", True)):
                entry.outputs[self.axis] = f"{PARTIAL}->{SEQ}"
            elif entry.style in RESIDUAL_READERS and entry.inputs.get(self.axis) == REPLICATE:
                entry.inputs[self.axis] = f"{SEQ}->{REPLICATE}"
            elif entry.style in RESIDUAL_BLOCKS and entry.inputs.get(self.axis) == REPLICATE:
                entry.inputs[self.axis], entry.outputs[self.axis] = f"{SEQ}->{REPLICATE}", f"{REPLICATE}->{SEQ}"
        chosen, unmatched = resolve_rules(program.modules, defaults, self.rules)
        if unmatched:
            names = ", ".join(f"Rule({r.pattern!r}, {r.style!r})" for r in unmatched)
            raise PlanError(f"SequenceParallel rule(s) {names} match no module. Fix: correct the pattern")
        for fqn, rule in chosen.items():
            entry = program.layout[fqn]
            if entry.style is not None:
                raise PlanError(
                    f"{fqn} already has style {entry.style!r} from TensorParallel; "
                    f"SequenceParallel cannot also give it {rule.style!r}"
                )
            entry.style = rule.style
            style(rule.style, "sequence_parallel").annotate(
                entry, program.modules[fqn], self.axis, program.mesh_shape[self.axis], dict(rule.options)
            )
            if rule.style == "gather_input" and not self._rejoins_residual(program, fqn):
                entry.outputs[self.axis] = f"{REPLICATE}->{SEQ}"
        if program.family is not None and self.builtin_rules:
            self._enter_and_leave(program)
        program.note(f"SequenceParallel({self.axis}): {len(chosen)} modules on sequence shards")

    def _enter_and_leave(self, program: Program) -> None:
        """Where the residual stream enters and leaves the sequence-sharded region when tensor
        parallelism left the embedding or the output layer whole (a TP layout of one's own):
        the embedding's output is split onto the sequence shards, the output layer's input
        gathered back."""
        size = program.mesh_shape[self.axis]
        facts = program.facts
        for fqn, kind, options in ((facts.embedding, "scatter_output", {}),
                                   (facts.output, "gather_input", {"args": 1})):
            entry = program.layout[fqn]
            if entry.style is None:
                entry.style = kind
                style(kind, "sequence_parallel").annotate(entry, program.modules[fqn], self.axis, size, options)

    def _rejoins_residual(self, program: Program, fqn: str) -> bool:
        """Whether something inside `fqn` reduce-scatters its output onto the sequence dim (a
        tensor-parallel row-wise linear); if not, the module computes the whole sequence
        replicated and its output must be split back onto the sequence shards."""
        return any(
            name.startswith(f"{fqn}.") and entry.outputs.get(self.axis) == f"{PARTIAL}->{SEQ}"
            for name, entry in program.layout.modules.items()
        )

    def apply(self, program: Program) -> None:
        count = apply_styles(program, "sequence_parallel", self.axis)
        program.note(f"SequenceParallel: materialized {count} modules")
