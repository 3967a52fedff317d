"""Replicas hold the same weights: a check that they do.

Every parameter the layout marks replicated over an axis (a norm weight over tensor-parallel
ranks, every dense weight over DDP's or HSDP's replicas and the context-parallel ranks, a
dense weight over the expert-parallel ranks) must be bit-identical on those ranks; a gradient
left different on one of them (a missing all-reduce), a corrupted copy or a wrong restore makes
the copies drift apart, and the model each rank trains is no longer the one the plan describes.
`check_replicas` hashes each local parameter (SHA-1 of its bytes, as Megatron's
`check_param_hashes_across_dp_replicas`), gathers the hashes over each group of replicas and
compares; any mismatch is raised on every rank (the answers are agreed over the world first, so
no rank goes on to a collective the others left). Megatron checks the data-parallel replicas
(`--check-weight-hash-across-dp-replicas-interval`) and, with `--test-mode`, the q/k norm weights
over TP and DP ranks; this checks every axis the layout replicates a parameter over.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtmega.kernels.errors import DtmegaError
from dtmega.passes.placements import REPLICATE

HASH_BYTES = 20  # SHA-1
WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


class ReplicaMismatch(DtmegaError):
    """Parameters that differ between ranks the layout says hold the same values."""


def _layout_name(name: str) -> str:
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _digest(param: torch.Tensor) -> torch.Tensor:
    local = param.to_local() if isinstance(param, DTensor) else param
    data = local.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return torch.frombuffer(bytearray(hashlib.sha1(data).digest()), dtype=torch.uint8)


def replica_axes(pm, name: str) -> tuple[str, ...]:
    """The mesh axes (of size > 1, the pipeline's excepted: stages hold other blocks) over which
    the layout replicates parameter `name`."""
    layout = pm.layout.param(_layout_name(name))
    pipeline = pm.program.axes.name("pipeline")
    return tuple(axis for axis, size in pm.layout.mesh.items()
                 if size > 1 and axis != pipeline and layout.placement(axis) == REPLICATE)


def check_replicas(pm) -> int:
    """Raises ReplicaMismatch, on every rank, naming each parameter whose copies differ and the
    ranks holding them; returns how many local parameters were checked. Collective over the
    world: call it on every rank at the same point (between optimizer steps)."""
    if pm.mesh is None or not dist.is_initialized() or pm.mesh.size() == 1:
        return 0
    everyone = pm.program.flat_submesh(tuple(pm.layout.mesh)).get_group()  # this model's ranks
    by_axes: dict[tuple[str, ...], list[tuple[str, torch.Tensor]]] = {}
    for name, param in pm.named_parameters():
        axes = replica_axes(pm, name)
        if axes:
            by_axes.setdefault(axes, []).append((name, param))
    # every rank makes the same flattened groups in the same order (group creation is collective)
    combos: list = [None] * dist.get_world_size(everyone)
    dist.all_gather_object(combos, sorted(by_axes), group=everyone)
    device = pm.mesh.device_type
    found: list[str] = []
    for axes in sorted({tuple(axes) for combo in combos for axes in combo}):
        mesh = pm.program.flat_submesh(axes)
        params = by_axes.get(axes, [])
        if not params:  # the other ranks of this group hold the same (no) parameters: none to compare
            continue
        group = mesh.get_group()
        local = torch.stack([_digest(param) for _, param in params]).to(device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        ranks = dist.get_process_group_ranks(group)
        for index, (name, _) in enumerate(params):
            differing = [ranks[r] for r, other in enumerate(gathered) if not torch.equal(other[index], gathered[0][index])]
            if differing and dist.get_rank() == ranks[0]:  # one report per group
                found.append(f"{name} over {' x '.join(axes)}: ranks {differing} differ from rank {ranks[0]}")
    reports: list = [None] * dist.get_world_size(everyone)
    dist.all_gather_object(reports, found, group=everyone)
    mismatches = [line for report in reports for line in report]
    if mismatches:
        shown = "; ".join(mismatches[:8]) + (f"; and {len(mismatches) - 8} more" if len(mismatches) > 8 else "")
        raise ReplicaMismatch(
            f"replicated weights differ between ranks that must hold the same values: {shown}. The ranks no longer "
            "train one model (a gradient left unreduced over those ranks, corrupted memory or a faulty restore). "
            "Fix: stop and resume from the last checkpoint; if it recurs at the same parameters, report it with "
            "the plan (dtmega.parallelize's layout table)"
        )
    return sum(len(params) for params in by_axes.values())
