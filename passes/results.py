"""Typed pass results: what a pass decides in `annotate` and later code needs to know.

A pass that leaves information behind records one frozen dataclass in the program
(`program.record(ContextSharding(...))`); whoever needs it asks by type
(`program.result(ContextSharding)`), never by a string key. Results are plain data: they
serialize into the layout's TOML (`Layout.results`) beside the placements, so a saved layout
says everything the plan decided. Runtime objects (process groups, statistics) are not results;
they live in the pass's runtime hook.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PassResult:
    """Base of every result: frozen, plain-data fields."""

    def to_dict(self) -> dict[str, Any]:
        """The fields as TOML-ready data (tuples become lists, None values are left out)."""
        def plain(value):
            if isinstance(value, tuple):
                return [plain(v) for v in value]
            return value

        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class TensorParallelism(PassResult):
    """Tensor parallelism over `axis` (and whether sequence parallelism reshaped it)."""

    axis: str
    size: int


@dataclass(frozen=True)
class ContextSharding(PassResult):
    """How every sequence is split over the context-parallel `axis`."""

    axis: str
    size: int
    method: str
    zigzag: bool
    targets: tuple[str, ...]  # the attention cores replaced (empty: a registered HF attention)

    @property
    def parts(self) -> int:
        """Number of equal chunks a sequence is cut into (2 x cp with zigzag)."""
        return 2 * self.size if self.zigzag else self.size


@dataclass(frozen=True)
class ExpertPlacement(PassResult):
    """Which modules hold experts and how they are split over the expert-parallel `axis`."""

    axis: str
    size: int
    experts: tuple[str, ...]
    dispatcher: str
    fold: tuple[str, ...] = ()  # axes the experts are also spread over, whole (ETP 1)


@dataclass(frozen=True)
class PipelineStages(PassResult):
    """The pipeline split: which blocks each stage holds, which rank runs it, the schedule."""

    axis: str
    schedule: str
    torch_schedule: str
    placement: str  # single | looped | v
    stages: int
    virtual_stages: int
    rank_of_stage: tuple[int, ...]
    blocks: tuple[tuple[str, ...], ...]
    microbatches: int

    def local_stages(self, pp_rank: int) -> list[int]:
        """The stages the pipeline rank `pp_rank` holds."""
        return [stage for stage, rank in enumerate(self.rank_of_stage) if rank == pp_rank]


@dataclass(frozen=True)
class DataParallelism(PassResult):
    """How the model is replicated/sharded over the data-parallel ranks."""

    mode: str
    size: int
    shard_axis: str
    replicate_axis: str


@dataclass(frozen=True)
class Compilation(PassResult):
    """Which blocks run compiled, and with what backend."""

    backend: str
    blocks: tuple[str, ...]
    dynamic: bool | None = None
