"""Which ranks an FP8 amax is reduced over (every FP8 backend's scales must be the whole tensor's)."""

from __future__ import annotations

from dtmega.passes.program import Program


def amax_group(program: Program):
    """The ranks whose pieces of the same tensors an amax must cover: tensor-parallel shards and
    the data (x context) ranks holding other tokens; None when that is this rank alone."""
    axes = [*program.data_axes(), program.axes.name("tensor")]
    wide = [axis for axis in axes if program.mesh_shape.get(axis, 1) > 1]
    return program.flat_submesh(wide).get_group() if wide else None
