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
