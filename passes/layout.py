"""The layout: the compiler's intermediate representation.

A table keyed by module FQN. Each entry says, per mesh axis, how the module's parameters are
placed, how its inputs are redistributed on the way in and its outputs on the way out, its
pipeline stage, recompute policy, kernel and precision. Passes write it in `annotate` (pure,
no tensors touched) and read it in `apply`. It serializes to TOML, diffs, and renders.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from dtmega.passes.errors import PlanError
from dtmega.passes.placements import REPLICATE, shard_dim
from dtmega.passes.precision import Precision
from dtmega.passes.toml_io import dump_toml, load_toml

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass
class ParamLayout:
    """One parameter: global shape, storage dtype, placement per mesh axis (absent axis = R)."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    placements: dict[str, str] = field(default_factory=dict)
    tied_to: str | None = None

    def placement(self, axis: str) -> str:
        """The placement on `axis` ("R" unless a pass sharded it)."""
        return self.placements.get(axis, REPLICATE)

    def local_shape(self, mesh: dict[str, int], coordinate: dict[str, int] | None = None) -> tuple[int, ...]:
        """Shape of the local shard at `coordinate` (default: every axis at 0, the largest shard).

        Shards are applied in the order passes wrote them (TP before FSDP), with
        `torch.chunk` semantics, as DTensor and FSDP2 do.
        """
        shape = list(self.shape)
        for axis, placement in self.placements.items():
            dim = shard_dim(placement)
            if dim is None:
                continue
            size = mesh.get(axis, 1)
            index = (coordinate or {}).get(axis, 0)
            chunk = math.ceil(shape[dim] / size) if shape[dim] else 0
            shape[dim] = max(0, min(chunk, shape[dim] - index * chunk))
        return tuple(shape)

    def local_bytes(self, mesh: dict[str, int], coordinate: dict[str, int] | None = None) -> int:
        """Bytes this parameter occupies on one rank (0 for a tied alias; its owner counts it)."""
        return 0 if self.tied_to is not None else self.shard_bytes(mesh, coordinate)

    def shard_bytes(self, mesh: dict[str, int], coordinate: dict[str, int] | None = None) -> int:
        """Bytes of this parameter's shard on one rank, alias or not (a stage's tied copy)."""
        return math.prod(self.local_shape(mesh, coordinate)) * _DTYPE_BYTES.get(self.dtype, 4)


@dataclass
class ModuleLayout:
    """Everything the plan decided about one module."""

    type: str
    params: dict[str, ParamLayout] = field(default_factory=dict)
    style: str | None = None
    inputs: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    stage: int | None = None
    virtual_stage: int | None = None
    recompute: str | None = None
    kernel: str | None = None
    compiled: str | None = None
    precision: Precision | None = None  # passes/precision.py; TOML holds its short text
    wrap: str | None = None

    def local_bytes(self, mesh: dict[str, int], coordinate: dict[str, int] | None = None) -> int:
        """Bytes of this module's own parameters on one rank."""
        return sum(p.local_bytes(mesh, coordinate) for p in self.params.values())


@dataclass
class LayoutChange:
    """One difference between two layouts."""

    fqn: str
    field: str
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"{self.fqn or '<root>'}.{self.field}: {self.before!r} -> {self.after!r}"


@dataclass
class Layout:
    """FQN -> ModuleLayout for one model on one mesh shape."""

    mesh: dict[str, int]
    modules: dict[str, ModuleLayout] = field(default_factory=dict)
    # Pipeline: which pp rank holds each stage (the stage's index in this list), and the axis.
    stage_ranks: list[int] | None = None
    stage_axis: str = "pp"
    # The passes' typed results as plain data, by result type name (see passes/results.py).
    results: dict[str, dict] = field(default_factory=dict)
    # How each pass uses each mesh axis: {axis: {pass: "batch" | "sequence" | "model"}}
    # (Pass.axis_uses). The batch is split over the "batch" axes and nothing else.
    axis_uses: dict[str, dict[str, str]] = field(default_factory=dict)
    # The cost analysis (dtmega.cost) of a plan checked with a workload: not part of the layout's
    # data (never in its TOML or its equality), derived from it.
    cost: Any = field(default=None, compare=False, repr=False)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch is split over (each holds different sequences), in mesh order."""
        return tuple(axis for axis in self.mesh if "batch" in self.axis_uses.get(axis, {}).values())

    def held(self, entry: "ModuleLayout", param: ParamLayout) -> bool:
        """Whether the ranks of `entry`'s stage allocate `param`: their own parameters, and a tied
        alias whose owner lives on another pipeline stage (that stage's copy, e.g. the last
        stage's output layer tied to the first stage's embedding)."""
        if param.tied_to is None:
            return True
        owner = self.modules.get(param.tied_to.rpartition(".")[0])
        return owner is not None and owner.stage is not None and entry.stage is not None and owner.stage != entry.stage

    def entry_bytes(self, entry: "ModuleLayout", coordinate: dict[str, int] | None = None) -> int:
        """Bytes of `entry`'s parameters on one of its ranks, a stage's tied copy included."""
        return sum(p.shard_bytes(self.mesh, coordinate) for p in entry.params.values() if self.held(entry, p))

    def _on_rank(self, entry: "ModuleLayout", coordinate: dict[str, int] | None) -> bool:
        if entry.stage is None or self.stage_ranks is None:
            return True
        return self.stage_ranks[entry.stage] == (coordinate or {}).get(self.stage_axis, 0)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_module(cls, module: nn.Module, mesh: dict[str, int]) -> "Layout":
        """An unsharded layout of `module`: every parameter replicated, nothing decided yet."""
        layout = cls(mesh=dict(mesh))
        owners: dict[int, str] = {}
        for fqn, sub in module.named_modules(remove_duplicate=False):
            entry = ModuleLayout(type=type(sub).__name__)
            for name, param in sub.named_parameters(recurse=False, remove_duplicate=False):
                full = f"{fqn}.{name}" if fqn else name
                tied = owners.setdefault(id(param), full)
                entry.params[name] = ParamLayout(
                    shape=tuple(param.shape),
                    dtype=str(param.dtype).removeprefix("torch."),
                    tied_to=None if tied == full else tied,
                )
            layout.modules.setdefault(fqn, entry)
        return layout

    # ---- access -------------------------------------------------------------------------------
    def __getitem__(self, fqn: str) -> ModuleLayout:
        try:
            return self.modules[fqn]
        except KeyError:
            raise KeyError(f"no module {fqn!r} in the layout") from None

    def __contains__(self, fqn: str) -> bool:
        return fqn in self.modules

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)

    def params(self) -> Iterator[tuple[str, ParamLayout]]:
        """Every parameter as (full FQN, ParamLayout), tied aliases included."""
        for fqn, entry in self.modules.items():
            for name, param in entry.params.items():
                yield (f"{fqn}.{name}" if fqn else name), param

    def param(self, full_name: str) -> ParamLayout:
        """The ParamLayout of parameter `full_name` (e.g. "layers.0.attention.wq.weight")."""
        fqn, _, name = full_name.rpartition(".")
        try:
            return self.modules[fqn].params[name]
        except KeyError:
            raise KeyError(f"no parameter {full_name!r} in the layout") from None

    def local_param_count(self, coordinate: dict[str, int] | None = None) -> int:
        """Parameters held by the rank at `coordinate` (default: all zeros), tied weights once per
        rank (a pipeline stage's copy of a tied weight counts on its stage)."""
        return sum(
            math.prod(p.local_shape(self.mesh, coordinate))
            for entry in self.modules.values() if self._on_rank(entry, coordinate)
            for p in entry.params.values() if self.held(entry, p)
        )

    def local_bytes(self, coordinate: dict[str, int] | None = None) -> int:
        """Parameter bytes held by the rank at `coordinate`."""
        return sum(
            self.entry_bytes(entry, coordinate) for entry in self.modules.values() if self._on_rank(entry, coordinate)
        )

    def global_param_count(self) -> int:
        """Parameters of the unsharded model, tied weights once."""
        return sum(math.prod(p.shape) for _, p in self.params() if p.tied_to is None)

    # ---- serialization ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (no None values, so it is valid TOML)."""
        modules = {}
        for fqn, entry in self.modules.items():
            data = {k: v for k, v in asdict(entry).items() if v not in (None, {}, [])}
            if entry.precision is not None:
                data["precision"] = str(entry.precision)
            for param in data.get("params", {}).values():
                param["shape"] = list(param["shape"])
                for key in [k for k, v in param.items() if v in (None, {})]:
                    del param[key]
            modules[fqn] = data
        data = {"mesh": dict(self.mesh), "modules": modules}
        if self.stage_ranks is not None:
            data["pipeline"] = {"axis": self.stage_axis, "stage_ranks": list(self.stage_ranks)}
        if self.results:
            data["results"] = {name: dict(values) for name, values in self.results.items()}
        if self.axis_uses:
            data["axis_uses"] = {axis: dict(uses) for axis, uses in self.axis_uses.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Layout":
        """Inverse of `to_dict`."""
        known = {f.name for f in fields(ModuleLayout)}
        modules = {}
        for fqn, entry in data.get("modules", {}).items():
            unknown = set(entry) - known
            if unknown:
                raise PlanError(f"layout entry {fqn!r} has unknown fields {sorted(unknown)}")
            params = {
                name: ParamLayout(
                    shape=tuple(p["shape"]),
                    dtype=p.get("dtype", "float32"),
                    placements=dict(p.get("placements", {})),
                    tied_to=p.get("tied_to"),
                )
                for name, p in entry.get("params", {}).items()
            }
            precision = Precision.parse(entry["precision"]) if entry.get("precision") else None
            modules[fqn] = ModuleLayout(**{**entry, "params": params, "precision": precision})
        pipeline = data.get("pipeline", {})
        return cls(mesh=dict(data["mesh"]), modules=modules, stage_ranks=pipeline.get("stage_ranks"),
                   stage_axis=pipeline.get("axis", "pp"), results=dict(data.get("results", {})),
                   axis_uses={axis: dict(uses) for axis, uses in data.get("axis_uses", {}).items()})

    def to_toml(self, path: str | Path | None = None) -> str:
        """TOML text of the layout; also written to `path` if given."""
        return dump_toml(self.to_dict(), path)

    @classmethod
    def from_toml(cls, source: str | Path) -> "Layout":
        """Reads a layout from TOML text or a path to a .toml file."""
        return cls.from_dict(load_toml(source))

    # ---- comparison and display ---------------------------------------------------------------
    def diff(self, other: "Layout") -> list[LayoutChange]:
        """What changes from this layout to `other`, entry by entry and field by field."""
        changes: list[LayoutChange] = []
        if self.mesh != other.mesh:
            changes.append(LayoutChange("<mesh>", "shape", self.mesh, other.mesh))
        mine, theirs = self.to_dict()["modules"], other.to_dict()["modules"]
        for fqn in list(mine) + [f for f in theirs if f not in mine]:
            a, b = mine.get(fqn), theirs.get(fqn)
            if a is None or b is None:
                changes.append(LayoutChange(fqn, "<module>", a is not None, b is not None))
                continue
            for key in list(a) + [k for k in b if k not in a]:
                if a.get(key) != b.get(key):
                    changes.append(LayoutChange(fqn, key, a.get(key), b.get(key)))
        return changes

    def __rich__(self):
        from dtmega.passes.render import layout_table

        return layout_table(self)


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the spelling the layout stores."""
    return str(dtype).removeprefix("torch.")
