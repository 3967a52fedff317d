"""A researcher's pass that shards the embedding table over an axis of its choosing (vocab
rows, partial lookups all-reduced): a model-parallel use of that axis, whatever its name."""

from __future__ import annotations

from dataclasses import dataclass

from dtmega.passes import Pass, Program, apply_styles, style


@dataclass
class EmbeddingOverAxis(Pass):
    """The embedding's rows split over `axis`; every rank along it must see the same tokens."""

    axis: str = "dp_shard"

    def annotate(self, program: Program) -> None:
        size = program.axis_size(self.axis)
        fqn = program.facts.embedding
        entry = program.layout[fqn]
        entry.style = "embedding"
        style("embedding", "tensor_parallel").annotate(entry, program.modules[fqn], self.axis, size, {})

    def apply(self, program: Program) -> None:
        apply_styles(program, "tensor_parallel", self.axis)
