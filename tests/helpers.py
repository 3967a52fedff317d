"""Shared test helpers: the unsharded reference, and comparisons against it."""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtmega.models import Llama, LlamaConfig
from dtmega.testing import (  # noqa: F401 (the suite's names for the public comparison helpers)
    GRAD_RTOL,
    LOSS_RTOL,
    PARAM_RTOL,
    Comparison,
    assert_close_to_reference,
    assert_covers_parameters,
    compare_training,
    full,
    reference_loss,
    relative_error,
)

WORLD = 4  # ranks of the distributed suite


def debug_llama(**overrides) -> LlamaConfig:
    """The tiny config the suite uses."""
    return LlamaConfig.from_name("debug", **overrides)


def build_dtmega_llama(config: LlamaConfig, seed: int) -> tuple[nn.Module, Callable[[], nn.Module]]:
    """A materialized reference and a factory of meta-device copies to shard."""
    with torch.device("meta"):
        reference = Llama(config)
    reference.to_empty(device="cpu")
    reference.init_weights(seed=seed)

    def meta_copy() -> nn.Module:
        with torch.device("meta"):
            return Llama(config)

    return reference, meta_copy


def mesh_shape(**sizes: int) -> dict[str, int]:
    """A mesh shape for checking plans without a process group: every axis, size 1 unless given."""
    from dtmega.mesh import AXES

    return {axis: sizes.get(axis, 1) for axis in AXES}


_MESHES: dict = {}
_GROUPS: dict = {}


def mesh(**sizes: int):
    """A mesh of the given axis sizes (others 1) for the distributed suite: the 4-rank world is
    split into as many independent copies as fit, so 1- and 2-rank plans run on every rank.

    Every gloo process group keeps three threads whose idle polling slows every later
    collective, and a world of 4 has only a handful of distinct rank sets; so meshes are cached
    and built from one cached process group per rank set (`DeviceMesh.from_group`) instead of
    `split_world`'s fresh groups per axis. The mesh is the same as `split_world`'s."""
    from dtmega.mesh import AXES, resolve_mesh_sizes

    sizes = {axis: size for axis, size in sizes.items() if size != 1}
    sizes.setdefault("dp_shard", 1)
    key = tuple(sorted(sizes.items()))
    if key not in _MESHES:
        ranks = 1
        for size in sizes.values():
            ranks *= size
        axis_sizes = resolve_mesh_sizes(ranks, **{axis: sizes.get(axis, 1) for axis in AXES})
        world = torch.arange(WORLD, dtype=torch.int).view(WORLD // ranks, *axis_sizes.values())
        groups = [_group_along(world, dim) for dim in range(world.dim())]
        root = DeviceMesh.from_group(groups, "cpu", mesh=world, mesh_dim_names=("replica", *AXES))
        _MESHES[key] = root[AXES]
    return _MESHES[key]


def first_copy_mesh(**sizes: int):
    """`mesh(**sizes)` for a test whose plan needs fewer ranks than the world: ranks 0..n-1 (the
    first copy) run it and the other ranks skip it, instead of every copy repeating the same work
    on this machine's two cores. Every rank still calls it (an uncached mesh creates its process
    groups collectively). Only for tests whose collectives all run inside the mesh (the skipping
    ranks wait at the barrier after the test)."""
    built = mesh(**sizes)
    ranks = built.size()
    if dist.get_rank() >= ranks:
        import pytest

        first = "rank 0" if ranks == 1 else f"ranks 0-{ranks - 1}"
        pytest.skip(reason=f"the plan runs on {first}; a copy on this rank would repeat its work")
    return built


def first_ranks_mesh(**sizes: int):
    """A mesh of the given axis sizes on the first ranks of the world only (e.g. tp=3 on ranks
    0-2 of 4: a model whose head count only 3 divides); the other ranks get None and must skip
    the test's collectives. Every rank calls it (process groups are created collectively)."""
    from dtmega.mesh import AXES, resolve_mesh_sizes

    ranks = 1
    for size in sizes.values():
        ranks *= size
    axis_sizes = resolve_mesh_sizes(ranks, **{axis: sizes.get(axis, 1) for axis in AXES})
    grid = torch.arange(ranks, dtype=torch.int).view(*axis_sizes.values())
    groups = [_group_along(grid, dim) for dim in range(grid.dim())]
    if dist.get_rank() >= ranks:
        return None
    return DeviceMesh.from_group(groups, "cpu", mesh=grid, mesh_dim_names=AXES)


def _group_along(world: torch.Tensor, dim: int) -> dist.ProcessGroup:
    """This rank's process group along `dim` of the rank grid; every rank creates the missing
    groups in the same order, so the cache stays identical on all ranks."""
    mine = None
    for ranks in world.movedim(dim, -1).reshape(-1, world.size(dim)).tolist():
        key = tuple(ranks)
        if key not in _GROUPS:
            _GROUPS[key] = dist.group.WORLD if len(key) == WORLD else dist.new_group(list(key))
        if dist.get_rank() in key:
            mine = _GROUPS[key]
    return mine


def clone_module(module: nn.Module) -> nn.Module:
    """A deep copy with the same weights (for models built eagerly, e.g. HF and torchtitan)."""
    return copy.deepcopy(module)


# Two plans compute the same logits up to fp32 reduction order (~1e-6 relative): a choice whose
# margin (top-1 minus runner-up logit, or the draw's distance to a boundary of the cumulative
# distribution) is below this may go either way. A real divergence has margins of order 0.1.
NEAR_TIE = 1e-4


def assert_same_choices(a, b) -> None:
    """Two `Generation`s of the same model under different plans chose the same tokens, except
    from a near tie on (where both continuations are right, and they may part)."""
    for step, (x, y) in enumerate(zip(a.ids + [None], b.ids + [None])):
        if x != y:
            margin = min(a.margins[step], b.margins[step])
            assert margin < NEAR_TIE, (
                f"the generations part at token {step} ({x} vs {y}) where the choice had margin {margin:.2e}, "
                f"not a near tie (< {NEAR_TIE})")
            return
