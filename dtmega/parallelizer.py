"""`parallelize(model, mesh, plan)`: annotate every pass, validate, then apply every pass."""

from __future__ import annotations

from pathlib import Path

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtmega.cost.analysis import analyze
from dtmega.cost.hardware import Hardware, load_hardware
from dtmega.parallel_model import ParallelModel
from dtmega.passes import Layout, PassManager, Plan, PlanError, Program, Workload


def _as_plan(plan: Plan | list) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (list, tuple)):
        return Plan(plan)
    raise PlanError(f"plan must be a dtmega.Plan (or a list of passes), got {type(plan).__name__}")


def check_plan(model: nn.Module, mesh: DeviceMesh | dict[str, int], plan: Plan | list,
               workload: Workload | None = None, hardware: Hardware | str | None = None) -> Layout:
    """Annotates `plan` on `model` without touching a tensor or a process group and returns the
    layout. `mesh` may be {axis: size} (axes left out have size 1): a plan for 1024 ranks is
    checked on a laptop. With a `workload` (sequence length, micro-batch), the checks that need
    the step's shapes run too, and `layout.cost` holds the cost analysis: memory, FLOPs and bytes
    per collective of the busiest rank, and its step time on `hardware` (a built-in name such as
    "h100", a `dtmega calibrate` file, or a `Hardware`) if given."""
    program = Program.build(model, mesh, workload)
    PassManager(_as_plan(plan).passes).annotate(program)
    _analyze(program, hardware)
    return program.layout


def _analyze(program: Program, hardware: Hardware | str | None) -> None:
    """The cost analysis passes: read the annotated layout, touch no tensor."""
    if isinstance(hardware, (str, Path)):
        hardware = load_hardware(hardware)
    program.layout.cost = analyze(program, hardware)


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: Plan | list, workload: Workload | None = None,
                hardware: Hardware | str | None = None) -> ParallelModel:
    """Shards `model` (unsharded, possibly on the meta device) over `mesh` as `plan` says.

    Every pass annotates first; only when the whole plan checks out is anything materialized,
    so a bad plan raises PlanError on every rank before any collective. Assumes every rank
    passes the same model (same weights, or meta); sharding keeps each rank's slice.
    """
    if not isinstance(mesh, DeviceMesh):
        raise PlanError(f"mesh must be a DeviceMesh from dtmega.make_mesh(...), got {type(mesh).__name__}")
    plan = _as_plan(plan)
    program = Program.build(model, mesh, workload)
    manager = PassManager(plan.passes)
    manager.annotate(program)
    _analyze(program, hardware)
    manager.apply(program)
    return ParallelModel(program, plan)
