"""The tensor-parallel style MLA adds: "shared_across_heads", for a tensor every head reads
(the rotary key), whose gradient each TP rank holds a partial sum of (its heads' share)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from dtmega.passes.placements import PARTIAL, REPLICATE
from dtmega.passes.tp_styles import Style, register_style


class SumGradientOverHeads(ParallelStyle):
    """Hands the module (`SharedAcrossHeads`) the TP mesh its gradient is summed over."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.tp_mesh = device_mesh
        return module


def _annotate(entry, module, axis, size, options) -> None:
    entry.inputs[axis] = entry.outputs[axis] = REPLICATE
    entry.options["gradient"] = f"{PARTIAL}->{REPLICATE} over {axis}"  # shown in the layout


def _build(entry, axis) -> ParallelStyle:
    return SumGradientOverHeads()


SHARED_ACROSS_HEADS = register_style(Style("shared_across_heads", "tensor_parallel", _annotate, _build))
