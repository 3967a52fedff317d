"""The mesh axes the standard passes use, in Megatron's order (slowest to fastest).

`ep` borrows data-parallel ranks (the batch is split over dp_replicate x dp_shard x ep); cp
and tp ranks are nearest to each other. A mesh shape given as a dict may leave any of them out:
a missing axis has size 1.
"""

from __future__ import annotations

from dtmega.passes.errors import PlanError

STANDARD_AXES = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")


def complete_mesh_shape(sizes: dict[str, int]) -> dict[str, int]:
    """{axis: size} with every standard axis present (1 where not given), standard axes first
    in mesh order, then any other axes as given; PlanError for a size that is not a positive int."""
    for axis, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise PlanError(f"mesh axis {axis}={size!r} must be a positive integer")
    shape = {axis: sizes.get(axis, 1) for axis in STANDARD_AXES}
    shape.update({axis: size for axis, size in sizes.items() if axis not in shape})
    return shape


# What each axis is for, and the name the standard mesh gives it.
ROLES = {
    "pipeline": "pp",
    "data_replicate": "dp_replicate",
    "data_shard": "dp_shard",
    "expert": "ep",
    "context": "cp",
    "tensor": "tp",
}
class MeshAxes:
    """The one owner of axis names and sizes, asked by role (torchtitan's ParallelDims idea).

    Passes name the axis they use in their config (`TensorParallel(axis="model")`) and declare
    its role (`Pass.roles()`); everything else asks `axes.name("tensor")` / `axes.size("tensor")`
    instead of spelling "tp". A role no pass claims keeps its standard name (size 1 if the mesh
    has no such axis), so a plan may name its own axes and every pass still finds them.
    """

    def __init__(self, names: dict[str, str], shape: dict[str, int]):
        self.names = {**ROLES, **names}
        self.shape = dict(shape)

    @classmethod
    def from_passes(cls, passes, shape: dict[str, int]) -> "MeshAxes":
        """The roles the passes claim; PlanError if two passes claim one role on other axes."""
        names: dict[str, str] = {}
        owners: dict[str, str] = {}
        for current in passes:
            for role, axis in current.roles().items():
                if role not in ROLES:
                    raise PlanError(f"{current.name} claims an unknown axis role {role!r}; roles: {sorted(ROLES)}")
                if role in names and names[role] != axis:
                    raise PlanError(
                        f"{current.name} uses axis {axis!r} for {role} parallelism, but {owners[role]} uses "
                        f"{names[role]!r}. Fix: give both the same axis"
                    )
                names[role], owners[role] = axis, current.name
        return cls(names, shape)

    def name(self, role: str) -> str:
        """The mesh axis that plays `role` (e.g. "tensor" -> "tp")."""
        if role not in self.names:
            raise KeyError(f"unknown axis role {role!r}; roles: {sorted(ROLES)}")
        return self.names[role]

    def size(self, role: str) -> int:
        """Number of ranks along the axis of `role` (1 if the mesh has no such axis)."""
        return self.shape.get(self.name(role), 1)
