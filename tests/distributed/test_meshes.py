"""The suite's cached meshes are the library's meshes, and flattening one axis makes no group."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn

from dtmega.mesh import make_mesh, split_world
from dtmega.passes.program import Program
from tests.helpers import WORLD, mesh


def describe(device_mesh) -> tuple:
    """Names, rank grid, and this rank's group members along every axis."""
    groups = tuple(tuple(dist.get_process_group_ranks(device_mesh.get_group(i))) for i in range(device_mesh.ndim))
    return device_mesh.mesh_dim_names, device_mesh.mesh.tolist(), groups


@pytest.mark.parametrize("sizes", [dict(tp=2), dict(cp=2, dp_shard=2), dict(pp=2, ep=2)], ids=str)
def test_cached_mesh_equals_split_world(sizes, fresh_library_meshes):
    ranks = 1
    for size in sizes.values():
        ranks *= size
    assert describe(mesh(**sizes)) == describe(split_world(WORLD // ranks, device_type="cpu", **sizes))


def test_cached_mesh_equals_make_mesh(fresh_library_meshes):
    assert describe(mesh(dp_shard=2, tp=2)) == describe(make_mesh(dp_shard=2, tp=2, device_type="cpu"))


def test_the_library_meshes_share_the_cached_meshes_groups():
    """tests/distributed/conftest.py: in the suite, `make_mesh` and `split_world` return the
    cached mesh of their sizes (one set of process groups per shape, not one per training run)."""
    assert make_mesh(dp_shard=2, tp=2, device_type="cpu") is mesh(dp_shard=2, tp=2)
    assert describe(split_world(2, tp=2, device_type="cpu")) == describe(mesh(tp=2))
    assert split_world(2, tp=2, device_type="cpu").get_group("tp") is mesh(tp=2).get_group("tp")


def test_flat_submesh_of_one_wide_axis_is_that_axis():
    program = Program.build(nn.Linear(2, 2), mesh(dp_shard=2, tp=2))
    data = program.flat_submesh(("dp_replicate", "dp_shard", "cp"))
    assert data.mesh_dim_names == ("dp_shard",)
    assert data.get_group() is program.mesh["dp_shard"].get_group()
    both = program.flat_submesh(("dp_shard", "tp"))
    assert both.mesh_dim_names == ("dp_shard_tp",) and both.size() == 4
