"""Sharding-invariant parameter initialization.

A sharded model initialized after sharding must hold exactly the weights the unsharded model
would have on the same seed, on every backend: otherwise "numerics match the unsharded model"
stops at step 0. DTensor's own random ops only guarantee that on CUDA, so every value here is a
pure function of (seed, parameter name, global row): each rank generates just the row blocks that
overlap its shard and keeps the entries it owns, whatever the placements are.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

# Rows generated per random block: small enough to bound memory for 16k-wide rows, large
# enough that generator start-up does not dominate.
_ROWS_PER_BLOCK = 256


@dataclass(frozen=True)
class InitSpec:
    """How one parameter is initialized: a distribution and its scale."""

    kind: Literal["normal", "trunc_normal", "ones", "zeros"]
    std: float = 0.02
    # the name whose values these are, when not the parameter's own: a tied output layer's copy
    # on the last pipeline stage starts as the word embedding it is tied to
    key: str | None = None

    def sample(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """Draws a block of values (fp32, CPU) from this distribution."""
        if self.kind == "ones":
            return torch.ones(shape)
        if self.kind == "zeros":
            return torch.zeros(shape)
        out = torch.empty(shape)
        if self.kind == "normal":
            return out.normal_(0.0, self.std, generator=generator)
        return nn.init.trunc_normal_(out, 0.0, self.std, -3 * self.std, 3 * self.std, generator=generator)


def _global_indices(param: torch.Tensor) -> list[torch.Tensor]:
    """For each dim, the global indices this rank's local shard holds (in local order)."""
    if not isinstance(param, DTensor):
        return [torch.arange(n) for n in param.shape]
    indices = [torch.arange(n) for n in param.shape]
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return [torch.arange(0) for _ in param.shape]
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, _StridedShard):
            along_zero = _StridedShard(0, split_factor=placement.split_factor)
        elif isinstance(placement, Shard):
            along_zero = Shard(0)
        else:
            continue
        chunks, _ = along_zero._split_tensor(indices[placement.dim], mesh.size(mesh_dim), with_padding=False)
        indices[placement.dim] = chunks[coordinate[mesh_dim]]
    return indices


def _seed_for(seed: int, name: str, block: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode()) * 7919 + block) % (2**63 - 1)


@torch.no_grad()
def fill_parameter(param: torch.Tensor, spec: InitSpec, *, seed: int, name: str) -> None:
    """Fills `param` (plain or DTensor, any placements) with its slice of the global init."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.numel() == 0:
        return
    if spec.kind in ("ones", "zeros"):
        local.fill_(1.0 if spec.kind == "ones" else 0.0)
        return
    indices = _global_indices(param)
    global_shape = tuple(param.shape)
    sorted_rows, local_order = torch.sort(indices[0])
    trailing = global_shape[1:]
    rows_per_block = max(1, _ROWS_PER_BLOCK * 4096 // max(1, math.prod(trailing)))
    generator = torch.Generator()
    pieces = []
    for block in torch.unique(sorted_rows // rows_per_block).tolist():
        start = block * rows_per_block
        stop = min(start + rows_per_block, global_shape[0])
        generator.manual_seed(_seed_for(seed, name, block))
        values = spec.sample((stop - start, *trailing), generator)
        in_block = sorted_rows[(sorted_rows >= start) & (sorted_rows < stop)]
        pieces.append(values[in_block - start])
    ascending = torch.cat(pieces)
    block_values = torch.empty_like(ascending)
    block_values[local_order] = ascending
    for dim, index in enumerate(indices[1:], start=1):
        block_values = block_values.index_select(dim, index)
    local.copy_(block_values.to(local.dtype))


def init_parameters(
    module: nn.Module, spec_for: Callable[[str, nn.Parameter], InitSpec], *, seed: int = 0
) -> None:
    """Initializes every parameter of `module` so the result is independent of how it is sharded."""
    for name, param in module.named_parameters():
        spec = spec_for(name, param)
        fill_parameter(param, spec, seed=seed, name=spec.key or name)
