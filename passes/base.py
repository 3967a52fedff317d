"""The pass protocol: a dataclass config with an `annotate` half and an `apply` half.

`annotate(program)` is pure: it reads the model's structure and the mesh shape and writes the
layout (or raises PlanError). `apply(program)` materializes what was annotated. A pass declares
the capabilities it `provides`, those it `requires` from earlier passes, and those it must run
`after` whenever the plan contains them. `{axis}` in a capability is filled from the pass's
own `axis` field, so "sequence parallel needs tensor parallel *on the same axis*" is one line.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, ClassVar

from dtmega.passes.errors import PlanError
from dtmega.passes.program import Program
from dtmega.passes.rules import Rule

_PASS_TYPES: dict[str, type["Pass"]] = {}
# How an axis of each role is used (passes/axes.py ROLES); an axis of no role splits the model.
USE_OF_ROLE = {"data_replicate": "batch", "data_shard": "batch", "expert": "batch", "context": "sequence"}


class Pass:
    """Base class of every pass. Subclasses are dataclasses; their fields are the pass's config."""

    requires: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ()
    after: ClassVar[tuple[str, ...]] = ()
    # Capability globs (or class names) of passes whose layout decisions this pass may change
    # (refine): any other change to a decision another pass made is refused (passes/decisions.py).
    refines: ClassVar[tuple[str, ...]] = ()
    # Structural passes change which modules exist on this rank (pipeline splitting); they apply
    # before every other pass, whatever their place in the plan, so the others shard the pieces.
    structural: ClassVar[bool] = False
    # Per-token batch fields this pass reads beyond tokens, labels, loss_mask and position_ids
    # (e.g. document ids): a batch must carry them, and they are sharded with it (runtime.Batch).
    batch_fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _PASS_TYPES[cls.__name__] = cls

    # ---- the two halves -----------------------------------------------------------------------
    def annotate(self, program: Program) -> None:
        """Writes this pass's decisions into `program.layout`; raises PlanError if it cannot."""
        raise NotImplementedError

    def apply(self, program: Program) -> None:
        """Materializes the decisions `annotate` wrote (shards, wraps, swaps modules), and adds
        what the pass does at run time: `program.add_hook(RuntimeHook)` (passes/runtime.py), or
        `program.executor = ...` to replace the micro-batch loop (pipelining)."""
        raise NotImplementedError

    def finalize(self, program: Program) -> None:
        """Checks that need the whole annotated plan (runs after every `annotate`; pure). With a
        `program.workload` known, also the checks that need the step's shapes."""

    # ---- declarations -------------------------------------------------------------------------
    # The axis role this pass's `axis` field plays ("tensor", "context", ...; passes/axes.py).
    role: ClassVar[str | None] = None

    def mesh_axes(self) -> tuple[str, ...]:
        """Mesh axes this pass parallelizes over (each axis of size > 1 needs an owner)."""
        axis = getattr(self, "axis", None)
        return (axis,) if axis else ()

    def axis_uses(self) -> dict[str, str]:
        """How this pass uses each of its axes, recorded in the layout (`Layout.axis_uses`):
        "batch" (ranks along it hold different sequences of the batch: data and expert
        parallelism), "sequence" (different parts of each sequence: context parallelism) or
        "model" (ranks along it see the same tokens and split the model or its work: tensor,
        pipeline, a researcher's own sharding). Derived from the axis's role; the batch is split
        over the "batch" axes only, and an axis used as "model" by one pass and to split the
        batch by another is refused (`check_axis_uses`)."""
        roles = {axis: role for role, axis in self.roles().items()}
        return {axis: USE_OF_ROLE.get(roles.get(axis), "model") for axis in self.mesh_axes()}

    def roles(self) -> dict[str, str]:
        """{role: axis} this pass claims, so other passes find its axis by role."""
        axis = getattr(self, "axis", None)
        return {self.role: axis} if self.role and axis else {}

    def _fill(self, capabilities: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(c.format(axis=getattr(self, "axis", "")) for c in capabilities)

    def provided(self) -> tuple[str, ...]:
        """Capabilities this pass provides, with `{axis}` filled in."""
        return self._fill(self.provides)

    def required(self) -> tuple[str, ...]:
        """Capabilities that an earlier pass must provide."""
        return self._fill(self.requires)

    def runs_after(self) -> tuple[str, ...]:
        """Capability globs that, if any pass in the plan provides them, must come earlier."""
        return self._fill(self.after)

    def refined(self) -> tuple[str, ...]:
        """Capability globs of the passes whose layout decisions this pass may change."""
        return self._fill(self.refines)

    # ---- config -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The pass's class name, as plans spell it."""
        return type(self).__name__

    def to_dict(self) -> dict[str, Any]:
        """The pass's config as plain data (TOML-ready)."""
        data: dict[str, Any] = {"pass": self.name}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, (list, tuple)) and value and isinstance(value[0], Rule):
                value = [rule.to_dict() for rule in value]
            data[f.name] = value
        return data

    @staticmethod
    def registered(name: str) -> type["Pass"] | None:
        """The pass class of that name (registered when its module was imported), or None."""
        return _PASS_TYPES.get(name)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Pass":
        """Builds a pass from `to_dict` output; the pass class must have been imported."""
        data = dict(data)
        name = data.pop("pass", None)
        if name not in _PASS_TYPES:
            raise PlanError(
                f"unknown pass {name!r}; known passes: {', '.join(sorted(_PASS_TYPES))}. "
                "A custom pass must be imported before the plan is read"
            )
        cls = _PASS_TYPES[name]
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - known
        if unknown:
            raise PlanError(f"{name} has no option(s) {sorted(unknown)}; its options are {sorted(known)}")
        return cls(**data)


def matches_capability(pattern: str, capability: str) -> bool:
    """Capability globs: 'tensor_parallel@*' matches 'tensor_parallel@tp'."""
    return fnmatch.fnmatchcase(capability, pattern)
