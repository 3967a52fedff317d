"""The pass manager: check the plan, annotate everything, then apply everything.

Every check here runs on facts every rank shares (the plan, the model's shapes, the mesh
shape), before any parameter is materialized or any collective is issued, so a bad plan
fails with the same message on every rank instead of hanging.
"""

from __future__ import annotations

from typing import Sequence

from dtmega.kernels.registry import kernel_spec, kernels_for
from dtmega.passes.axes import MeshAxes
from dtmega.passes.base import Pass, matches_capability
from dtmega.passes.decisions import decisions_of
from dtmega.passes.errors import PlanError
from dtmega.passes.program import Program

# What an axis is for, to make "nobody uses this axis" errors actionable.
_AXIS_OWNERS = {
    "pp": "PipelineSplit(axis='pp')",
    "dp_replicate": "DataParallel(mode='hsdp') or DataParallel(mode='ddp')",
    "dp_shard": "DataParallel(mode='fsdp')",
    "ep": "ExpertParallel(axis='ep')",
    "cp": "ContextParallel(axis='cp')",
    "tp": "TensorParallel(axis='tp')",
}


def check_order(passes: Sequence[Pass]) -> None:
    """Raises PlanError if a pass lacks a prerequisite, runs too early, or repeats a capability."""
    provided_by: dict[str, str] = {}
    for index, current in enumerate(passes):
        for needed in current.required():
            if needed not in provided_by:
                later = [p.name for p in passes[index + 1:] if needed in p.provided()]
                hint = (
                    f"move {later[0]} before {current.name}" if later
                    else f"add a pass that provides it before {current.name}"
                )
                raise PlanError(f"{current.name} requires {needed!r}, which no earlier pass provides. Fix: {hint}")
        for pattern in current.runs_after():
            for later in passes[index + 1:]:
                hits = [c for c in later.provided() if matches_capability(pattern, c)]
                if hits:
                    raise PlanError(
                        f"passes out of order: {current.name} must run after {later.name} "
                        f"({current.name} wraps or consumes what {later.name} produces: {hits[0]}). "
                        f"Fix: put {later.name} before {current.name} in the plan"
                    )
        for capability in current.provided():
            if capability in provided_by:
                raise PlanError(
                    f"{current.name} and {provided_by[capability]} both provide {capability!r}; "
                    "keep one of them"
                )
            provided_by[capability] = current.name


def check_axes(passes: Sequence[Pass], mesh_shape: dict[str, int]) -> None:
    """Every pass's axes exist, and every mesh axis of size > 1 is used by some pass."""
    used: dict[str, str] = {}
    for current in passes:
        for axis in current.mesh_axes():
            if axis not in mesh_shape:
                raise PlanError(
                    f"{current.name} uses mesh axis {axis!r}, but the mesh has only {list(mesh_shape)}"
                )
            used.setdefault(axis, current.name)
    for axis, size in mesh_shape.items():
        if size > 1 and axis not in used:
            owner = _AXIS_OWNERS.get(axis, "a pass that uses it")
            raise PlanError(
                f"mesh axis {axis!r} has size {size} but no pass in the plan uses it, so its ranks "
                f"would silently compute the same or diverging things. Fix: add {owner} to the plan, "
                f"or build the mesh with {axis}=1"
            )


def record_axis_uses(passes: Sequence[Pass], program: Program) -> None:
    """Writes how every pass uses its axes into the layout (`Layout.axis_uses`), then refuses an
    axis of size > 1 that one pass splits the model over while another splits the batch (or the
    sequences) over it: the model-parallel pass needs the same tokens on every rank along it."""
    uses = program.layout.axis_uses
    for current in passes:
        for axis, use in current.axis_uses().items():
            uses.setdefault(axis, {})[current.name] = use
    for axis, by_pass in uses.items():
        if program.mesh_shape.get(axis, 1) < 2:
            continue
        model = [name for name, use in by_pass.items() if use == "model"]
        split = {name: use for name, use in by_pass.items() if use != "model"}
        if model and split:
            splitter, use = next(iter(split.items()))
            what = "the batch (each rank other sequences)" if use == "batch" else "each sequence (context parallelism)"
            raise PlanError(
                f"mesh axis {axis!r} is used two ways: {model[0]} splits the model over it, so every rank along "
                f"it must see the same tokens, but {splitter} splits {what} over it. Fix: give {model[0]} a mesh "
                f"axis of its own (e.g. {{'model': {program.mesh_shape[axis]}}} with {model[0]}(axis='model')), "
                f"or leave {axis!r} to {splitter}"
            )


def check_workload(program: Program) -> None:
    """What the step's shapes demand of the model itself (each pass checks its own in finalize)."""
    workload = program.workload
    if workload is None or program.family is None:
        return
    limit = program.facts.max_positions
    if limit is not None and workload.seq_len > limit:
        raise PlanError(
            f"sequence length {workload.seq_len} is longer than the model's position table ({limit} positions). "
            f"Fix: a model config with at least {workload.seq_len} positions (--max-position-embeddings), or "
            "shorter sequences"
        )


def check_kernels(program: Program, device_type: str | None) -> None:
    """Every kernel the layout names is registered and, on `device_type`, can run there."""
    for fqn, entry in program.layout.modules.items():
        if entry.kernel is None:
            continue
        try:
            spec = kernel_spec(entry.kernel)
        except KeyError as error:
            raise PlanError(f"{fqn or '<root>'}: {error.args[0]}. Fix: register it with "
                            "dtmega.kernels.register_kernel, or choose a registered one") from None
        reason = spec.unavailable(device_type)
        if reason:
            raise PlanError(f"{fqn or '<root>'}: {reason}. Fix: choose another kernel for {spec.op} "
                            f"({', '.join(k.name for k in kernels_for(spec.op))})")


class PassManager:
    """Runs a sequence of passes over a program: checks, annotate all, apply all."""

    def __init__(self, passes: Sequence[Pass]):
        for p in passes:
            if not isinstance(p, Pass):
                raise PlanError(f"{p!r} is not a pass; a plan holds instances such as TensorParallel()")
        self.passes = list(passes)

    def annotate(self, program: Program) -> None:
        """Checks the plan and writes the whole layout. Pure: no tensor is touched."""
        check_order(self.passes)
        check_axes(self.passes, program.mesh_shape)
        program.axes = MeshAxes.from_passes(self.passes, program.mesh_shape)
        record_axis_uses(self.passes, program)
        decided = decisions_of(program.layout)
        for current in self.passes:
            current.annotate(program)
            now = decisions_of(program.layout)
            program.decisions.record(decided, now, current)  # no pass silently replaces another's decision
            decided = now
            program.note(f"annotated {current.name}")
        for current in self.passes:
            current.finalize(program)
        check_kernels(program, device_type=None)
        check_workload(program)

    def apply(self, program: Program) -> None:
        """Materializes the annotated layout, pass by pass in plan order."""
        if program.mesh is None:
            raise RuntimeError("apply needs a DeviceMesh; this program was built for annotation only")
        check_kernels(program, device_type=program.mesh.device_type)
        for current in sorted(self.passes, key=lambda p: not p.structural):  # stable: plan order otherwise
            current.apply(program)
            program.note(f"applied {current.name}")
