"""Process groups and the named device mesh every plan runs on."""

from __future__ import annotations

import contextlib
import math
import os
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtmega.joining import rendezvous
from dtmega.passes.axes import (
    STANDARD_AXES as AXES,  # Megatron's order, slowest to fastest
)
from dtmega.passes.errors import PlanError


def default_device_type() -> str:
    """'cuda' where a GPU is visible, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(device_type: str | None = None, timeout: timedelta = timedelta(minutes=10)) -> None:
    """Joins the job's process group if it is not joined yet.

    Under torchrun (RANK/WORLD_SIZE set) that is the launched world, on nccl for CUDA (with gloo
    for CPU tensors) and gloo for CPU; otherwise a one-rank world, so single-process scripts
    and notebooks run the same code. Every rank is waited for at most `timeout` (also the
    collectives' timeout), and ranks that never arrive are named (joining.py).
    """
    if dist.is_initialized():
        return
    device_type = device_type or default_device_type()
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        store, rank, world = rendezvous(timeout)
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def gather_objects(value: Any, group=None) -> list:
    """Every rank's `value` (any picklable object) on every rank of `group` (default: the
    world), in rank order; just `[value]` without a process group or in a group of one."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [value]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def broadcast_object(value: Any, group=None) -> Any:
    """Rank 0's `value` (any picklable object; what other ranks pass is ignored) on every rank
    of `group` (default: the world); just `value` without a process group or in a group of one."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


@contextlib.contextmanager
def simulate_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake process group of `world_size` ranks in this one process (no communication).

    For checking plans of thousands of ranks on a laptop: meshes, sharding and layouts are real,
    collectives are no-ops. Use it with models on the meta device.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized; simulate_world needs a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def resolve_mesh_sizes(world_size: int, **sizes: int) -> dict[str, int]:
    """Axis sizes in mesh order with the (at most one) -1 filled in; PlanError if they do not
    multiply to the world size."""
    for axis, size in sizes.items():
        if not isinstance(size, int) or (size < 1 and size != -1):
            raise PlanError(f"mesh axis {axis}={size!r} must be a positive integer (or -1 to fill the rest)")
    fill = [axis for axis, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise PlanError(f"only one mesh axis may be -1, got {fill}")
    _check_expert_ranks(world_size, sizes)
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if world_size % known:
            raise PlanError(
                f"the other mesh axes multiply to {known}, which does not divide the world size "
                f"{world_size}, so {fill[0]}=-1 cannot be filled. Fix: choose sizes whose product divides {world_size}"
            )
        sizes[fill[0]] = world_size // known
    product = math.prod(sizes.values())
    if product != world_size:
        shape = " x ".join(f"{axis}={size}" for axis, size in sizes.items())
        raise PlanError(
            f"the mesh {shape} has {product} ranks but the world has {world_size} (torchrun "
            f"--nproc-per-node x --nnodes). Fix: make the axes multiply to {world_size}, or launch "
            f"{product} ranks"
        )
    return sizes


def _check_expert_ranks(world_size: int, sizes: dict[str, int]) -> None:
    """ep borrows data-parallel ranks: it must divide the ranks left after pp, cp and tp."""
    ep = sizes.get("ep", 1)
    if ep == 1:
        return
    model_ranks = math.prod(sizes.get(axis, 1) for axis in ("pp", "cp", "tp"))
    data_ranks = world_size // model_ranks if world_size % model_ranks == 0 else 0
    if data_ranks % ep:
        raise PlanError(
            f"ep={ep}: expert parallelism borrows its ranks from data parallelism, but the world of {world_size} "
            f"ranks has {data_ranks} data-parallel ranks (world / (pp x cp x tp) = {world_size} / {model_ranks}), "
            f"which {ep} does not divide. Fix: use an ep that divides {data_ranks}, or launch more ranks"
        )


def make_mesh(
    *,
    pp: int = 1,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    cp: int = 1,
    tp: int = 1,
    ep: int = 1,
    device_type: str | None = None,
) -> DeviceMesh:
    """The job's named mesh, axes ordered pp, dp_replicate, dp_shard, ep, cp, tp (every axis is
    present, size 1 when unused). `-1` fills the rest of the world.

    `ep` (expert parallelism) borrows data-parallel ranks: the batch is split over
    dp_replicate x dp_shard x ep ranks, dense weights are data-parallel over all of them, and
    the experts are sharded over ep. Works under torchrun, in a one-rank process, and inside
    `simulate_world`.
    """
    device_type = device_type or default_device_type()
    init_distributed(device_type)
    sizes = resolve_mesh_sizes(
        dist.get_world_size(), pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, ep=ep, cp=cp, tp=tp
    )
    return init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=AXES)


def split_world(
    replicas: int,
    *,
    pp: int = 1,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    ep: int = 1,
    cp: int = 1,
    tp: int = 1,
    device_type: str | None = None,
) -> DeviceMesh:
    """This rank's mesh when the world is split into `replicas` independent meshes (e.g. two
    2-rank TP jobs in a 4-rank world). Every rank gets a mesh with the same axes as
    `make_mesh`; ranks of different replicas never communicate."""
    device_type = device_type or default_device_type()
    init_distributed(device_type)
    world = dist.get_world_size()
    if replicas < 1 or world % replicas:
        raise PlanError(f"cannot split a world of {world} ranks into {replicas} equal meshes")
    sizes = resolve_mesh_sizes(
        world // replicas, pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, ep=ep, cp=cp, tp=tp
    )
    root = init_device_mesh(device_type, (replicas, *sizes.values()), mesh_dim_names=("replica", *AXES))
    return root[AXES]


def mesh_sizes(mesh: DeviceMesh) -> dict[str, int]:
    """{axis: size} of a named mesh."""
    return {name: mesh.size(i) for i, name in enumerate(mesh.mesh_dim_names or ())}
