"""The program a plan compiles: model, mesh, layout, and what each pass did."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtmega.passes.axes import complete_mesh_shape
from dtmega.passes.errors import PlanError
from dtmega.passes.families import ModelFacts, ModelFamily, family_of, known_families
from dtmega.passes.layout import Layout
from dtmega.passes.rules import glob_match

# Axes over which the global batch's sequences are split. Expert parallelism borrows its ranks
# from data parallelism, so `ep` is one of them; context parallelism splits each sequence.
BATCH_AXES = ("dp_replicate", "dp_shard", "ep")


def mesh_shape_of(mesh: DeviceMesh | dict[str, int]) -> dict[str, int]:
    """{axis: size} of a DeviceMesh, or of a dict in that form (standard axes it leaves out have
    size 1, so `check_plan(model, {"tp": 8, "dp_shard": 64}, plan)` needs no other axis)."""
    if isinstance(mesh, dict):
        return complete_mesh_shape(mesh)
    if not mesh.mesh_dim_names:
        raise PlanError("the mesh has no axis names; build it with dtmega.make_mesh(...)")
    return {name: mesh.size(i) for i, name in enumerate(mesh.mesh_dim_names)}


def submesh(mesh: DeviceMesh, *axes: str, flatten: str | None = None) -> DeviceMesh:
    """`mesh` restricted to `axes`, optionally flattened into one axis named `flatten`."""
    sub = mesh[axes[0]] if len(axes) == 1 else mesh[axes]
    if flatten is not None and len(axes) > 1:
        return sub._flatten(flatten)
    return sub


@dataclass
class Program:
    """What passes read and write. `mesh` is None when only annotating (checking a plan)."""

    model: nn.Module
    mesh_shape: dict[str, int]
    mesh: DeviceMesh | None = None
    layout: Layout = None  # type: ignore[assignment]
    family: ModelFamily | None = None
    log: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    # What this rank materializes: the model, or its pipeline stages (same FQNs, pruned).
    parts: list[nn.Module] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.parts:
            self.parts = [self.model]

    @classmethod
    def build(cls, model: nn.Module, mesh: DeviceMesh | dict[str, int]) -> "Program":
        """A program for `model` on `mesh` (a DeviceMesh, or {axis: size} to annotate only)."""
        shape = mesh_shape_of(mesh)
        return cls(
            model=model,
            mesh_shape=shape,
            mesh=None if isinstance(mesh, dict) else mesh,
            layout=Layout.from_module(model, shape),
            family=family_of(model),
        )

    # ---- facts --------------------------------------------------------------------------------
    @cached_property
    def modules(self) -> dict[str, nn.Module]:
        """FQN -> module of the unsharded model (root is "")."""
        return dict(self.model.named_modules())

    @cached_property
    def facts(self) -> ModelFacts:
        """Shape facts of the model; a PlanError if no registered family knows it."""
        if self.family is None:
            raise PlanError(
                f"no built-in rule set knows {type(self.model).__qualname__} "
                f"(known families: {', '.join(known_families())}). Fix: give the pass explicit "
                "rules/blocks, or register a family with dtmega.passes.register_family"
            )
        try:
            return self.family.describe(self.model)
        except Exception as error:  # a variant of the family the describer does not understand
            raise PlanError(
                f"the {self.family.name} rule set could not read the shape of "
                f"{type(self.model).__qualname__}: {error}"
            ) from error

    def blocks(self, pattern: str | None = None) -> list[str]:
        """FQNs of the repeated blocks: those matching `pattern`, else the family's."""
        if pattern is None:
            return list(self.facts.blocks)
        found = [fqn for fqn in self.modules if fqn and glob_match(pattern, fqn)]
        if not found:
            raise PlanError(f"blocks={pattern!r} matches no module; block FQNs look like 'layers.*'")
        return found

    def axis_size(self, axis: str) -> int:
        """Size of mesh axis `axis`; a PlanError naming the axes if it does not exist."""
        if axis not in self.mesh_shape:
            raise PlanError(f"mesh has no axis {axis!r}; its axes are {list(self.mesh_shape)}")
        return self.mesh_shape[axis]

    def submesh(self, *axes: str, flatten: str | None = None) -> DeviceMesh:
        """The DeviceMesh over `axes` (apply-time only); with `flatten`, those axes merged into
        one 1-D axis of that name (e.g. the data-parallel ranks as one group)."""
        if self.mesh is None:
            raise RuntimeError("this program was built for annotation only; it has no DeviceMesh")
        return submesh(self.mesh, *axes, flatten=flatten)

    def data_axes(self, *, context: bool = True) -> tuple[str, ...]:
        """The mesh axes whose ranks hold different tokens of the global batch: the batch axes,
        and `cp` when context parallelism splits sequences (`context`)."""
        axes = BATCH_AXES + (("cp",) if context and "context_parallel" in self.state else ())
        return tuple(axis for axis in axes if axis in self.mesh_shape)

    def data_size(self, *, context: bool = True) -> int:
        """Number of ranks holding different tokens (see `data_axes`)."""
        size = 1
        for axis in self.data_axes(context=context):
            size *= self.mesh_shape[axis]
        return size

    def flat_submesh(self, axes: tuple[str, ...] | list[str]) -> DeviceMesh:
        """The ranks along `axes` (those this mesh has) as one 1-D mesh (apply-time only).
        Axes of size 1 are left out, so one axis of size > 1 is its own mesh: no new process
        group (on GPUs, no new NCCL communicator) for a flattening that changes nothing."""
        present = [axis for axis in axes if axis in self.mesh_shape]
        wide = [axis for axis in present if self.mesh_shape[axis] > 1] or present[:1]
        return self.submesh(*wide, flatten="_".join(wide))

    def modules_at(self, fqn: str) -> list[nn.Module]:
        """The module at `fqn` in every local part that has it (the root is in every part; a
        block only in its pipeline stage's part; nothing when another rank holds it)."""
        found = []
        for part in self.parts:
            try:
                found.append(part.get_submodule(fqn) if fqn else part)
            except AttributeError:
                continue
        return found

    def module(self, fqn: str) -> nn.Module:
        """The one module at `fqn` (in the unsplit model, or the single part that has it)."""
        found = self.modules_at(fqn)
        if len(found) != 1:
            raise KeyError(f"{fqn!r} is in {len(found)} local parts, not exactly one")
        return found[0]

    def note(self, message: str) -> None:
        """Records what a pass did, for `ParallelModel.log`."""
        self.log.append(message)
