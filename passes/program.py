"""The program a plan compiles: model, mesh, layout, and what each pass did."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtmega.passes.axes import MeshAxes, complete_mesh_shape
from dtmega.passes.decisions import Decisions
from dtmega.passes.errors import PlanError
from dtmega.passes.families import ModelFacts, ModelFamily, family_of, known_families
from dtmega.passes.layout import Layout
from dtmega.passes.results import ContextSharding, PassResult
from dtmega.passes.rules import glob_match
from dtmega.passes.workload import Workload

R = TypeVar("R", bound=PassResult)


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
    # Typed results the passes recorded (`record` / `result`), one per type.
    results: dict[type, PassResult] = field(default_factory=dict)
    # Which mesh axis plays which role; set by the PassManager from the plan's passes.
    axes: MeshAxes = None  # type: ignore[assignment]
    # The shapes a step will run (sequence length, micro-batch), when known before launch.
    workload: Workload | None = None
    # What this rank materializes: the model, or its pipeline stages (same FQNs, pruned).
    parts: list[nn.Module] = field(default_factory=list)
    # Run time (set by the passes' apply): hooks into every step, and the executor that runs
    # a step's micro-batches (None: the plain micro-batch loop). See passes/runtime.py.
    hooks: list = field(default_factory=list)
    executor: object = None
    # Which pass made each layout decision (recorded by the PassManager; passes/decisions.py).
    decisions: Decisions = field(default_factory=Decisions)

    def __post_init__(self) -> None:
        if not self.parts:
            self.parts = [self.model]
        if self.axes is None:
            self.axes = MeshAxes({}, self.mesh_shape)

    @classmethod
    def build(cls, model: nn.Module, mesh: DeviceMesh | dict[str, int], workload: Workload | None = None) -> "Program":
        """A program for `model` on `mesh` (a DeviceMesh, or {axis: size} to annotate only)."""
        shape = mesh_shape_of(mesh)
        return cls(
            model=model,
            mesh_shape=shape,
            mesh=None if isinstance(mesh, dict) else mesh,
            layout=Layout.from_module(model, shape),
            family=family_of(model),
            workload=workload,
        )

    # ---- results --------------------------------------------------------------------------------
    def record(self, result: PassResult) -> None:
        """Records a pass's typed result (replacing one of the same type); it is also written
        into the layout, so a saved layout carries it."""
        self.results[type(result)] = result
        self.layout.results[type(result).__name__] = result.to_dict()

    def result(self, kind: type[R]) -> R | None:
        """The recorded result of type `kind`, or None if no pass recorded one."""
        return self.results.get(kind)  # type: ignore[return-value]

    def add_hook(self, hook, *, first: bool = False) -> None:
        """Adds a `RuntimeHook` to every step of the parallelized model; `first`: before every
        other hook (one that reads the whole data-parallel batch, before context parallelism
        cuts its sequences)."""
        if first:
            self.hooks.insert(0, hook)
        else:
            self.hooks.append(hook)

    def hook(self, kind: type):
        """The first runtime hook of type `kind`, or None."""
        return next((h for h in self.hooks if isinstance(h, kind)), None)

    def require(self, kind: type[R], who: str) -> R:
        """The recorded result of type `kind`; RuntimeError naming `who` needs it otherwise."""
        found = self.result(kind)
        if found is None:
            raise RuntimeError(f"{who} needs a {kind.__name__} result, which no pass recorded")
        return found

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
        """FQNs of the repeated blocks: those matching `pattern`, else the family's (its trunk's
        blocks, then those beside the output layer: `ModelFacts.head_blocks`)."""
        if pattern is None:
            return list(self.facts.blocks) + list(self.facts.head_blocks)
        found = [fqn for fqn in self.modules if fqn and glob_match(pattern, fqn)]
        if not found:
            raise PlanError(f"blocks={pattern!r} matches no module; block FQNs look like 'layers.*'")
        return found

    def axis_size(self, axis: str) -> int:
        """Size of mesh axis `axis`; a PlanError naming the axes if it does not exist."""
        if axis not in self.mesh_shape:
            raise PlanError(f"mesh has no axis {axis!r}; its axes are {list(self.mesh_shape)}")
        return self.mesh_shape[axis]

    def role_size(self, role: str) -> int:
        """Size of the axis playing `role` ("tensor", "context", ...; 1 if the mesh lacks it)."""
        return self.axes.size(role)

    def submesh(self, *axes: str, flatten: str | None = None) -> DeviceMesh:
        """The DeviceMesh over `axes` (apply-time only); with `flatten`, those axes merged into
        one 1-D axis of that name (e.g. the data-parallel ranks as one group)."""
        if self.mesh is None:
            raise RuntimeError("this program was built for annotation only; it has no DeviceMesh")
        return submesh(self.mesh, *axes, flatten=flatten)

    def data_axes(self, *, context: bool = True) -> tuple[str, ...]:
        """The mesh axes whose ranks hold different tokens of the global batch: the axes a pass
        splits the batch over (`Layout.batch_axes`: data and expert parallelism), and the context
        axis when context parallelism splits sequences (`context`)."""
        sharding = self.result(ContextSharding) if context else None
        return self.layout.batch_axes + ((sharding.axis,) if sharding and sharding.axis in self.mesh_shape else ())

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

    def decided_by(self, fqn: str, name: str) -> str | None:
        """The pass whose `annotate` wrote decision `name` of module `fqn` ("wrap", "kernel",
        "inputs[tp]", "params.weight[tp]"), or None if no pass did: a pass that fills what
        nobody decided reads it to leave the others' decisions alone, or to refuse naming them."""
        return self.decisions.decided_by(fqn, name)

    def note(self, message: str) -> None:
        """Records what a pass did, for `ParallelModel.log`."""
        self.log.append(message)
