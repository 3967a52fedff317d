"""FP8 all-gather of FSDP2-sharded weights for dtmega's own FP8 linear (Megatron's
`--fp8-param-gather`): each rank casts its shard of a weight to FP8 with the *whole* weight's
scale, FSDP2 gathers the FP8 bytes (a quarter of fp32's, half of bf16's), and the linear uses the
gathered FP8 weight as it is, with no cast of its own.

Two tensor subclasses plug into FSDP2's documented extension point (`fsdp_pre_all_gather` /
`fsdp_post_all_gather` on a parameter's local shard):

* `Float8ShardedWeight` wraps the high-precision shard FSDP2 keeps, the optimizer updates and
  checkpoints hold. Every op runs on the plain tensor inside; the ops FSDP2 uses to shard,
  pad and copy a parameter give the wrapper back, so the shard stays one.
* `Float8GatheredWeight` is the unsharded weight during forward and backward: FP8 data and its
  scale. The FP8 linear reads both; any other op sees the dequantized values.

The scale is the one the linear would have used on the high-precision weight: delayed scaling's
current weight scale once it has a history (no communication at all), else the whole weight's
amax, reduced (MAX) over every rank that holds a piece of it (FSDP shards and tensor-parallel
shards), so gathered and non-gathered runs quantize to the same FP8 values.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from dtmega.kernels.float8 import Float8Recipe, quantize
from dtmega.kernels.float8_scaling import W, tensor_scale
from dtmega.kernels.precision import accumulation_dtype

aten = torch.ops.aten

# What FSDP2 does to a parameter's shard (split, pad, copy, view, move): these keep the wrapper.
_KEEP_WRAPPER = {
    aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default, aten.slice.Tensor,
    aten.narrow.default, aten.copy_.default, aten.view.default, aten.as_strided.default,
    aten._to_copy.default, aten._pin_memory.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.clone.default, aten.detach.default, aten.alias.default,
}
# Views of the gathered FP8 weight FSDP2 makes (the unsharded parameter's shape and strides).
_GATHERED_VIEWS = {aten.as_strided.default, aten.view.default, aten.detach.default, aten.alias.default,
                   aten._unsafe_view.default, aten.slice.Tensor}


def _wrapper(cls, tensor: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
    return torch.Tensor._make_wrapper_subclass(
        cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=dtype,
        layout=tensor.layout, device=tensor.device, requires_grad=requires_grad)


class Float8GatherScale:
    """How the shards of one weight find their common scale before an all-gather.

    `scale()` is called on every rank holding a piece of the weight, in the same order (FSDP2
    gathers a unit's parameters in a fixed order) and follows the FP8 linear's own rule for its
    weight (`float8_linear.tensor_scale`): delayed scaling's weight scale once it has a history,
    else the shard's amax reduced over `group` (a collective). The shard's amax joins delayed
    scaling's history while `linear` trains (FSDP2 gathers under no_grad, so grad mode cannot
    tell; `counting` is off while a pipeline stage infers shapes)."""

    def __init__(self, recipe: Float8Recipe, state, group, linear: torch.nn.Module):
        self.recipe, self.state, self.group, self.linear = recipe, state, group, linear

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The FP8 type of weights (the recipe's forward type)."""
        return self.recipe.forward_dtype

    def scale(self, shard: torch.Tensor) -> torch.Tensor:
        """The scale every rank casts its shard of the weight with (see the class docstring)."""
        record = self.linear.training and getattr(self.linear, "counting", True)
        return tensor_scale(shard, W, self.fp8_dtype, self.recipe, self.state, self.group, record)


class Float8ShardedWeight(torch.Tensor):
    """A weight shard FSDP2 all-gathers in FP8 (see the module docstring)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, source: Float8GatherScale):
        return _wrapper(cls, tensor, tensor.dtype, tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, source: Float8GatherScale):
        self._tensor = tensor
        self._source = source

    def __repr__(self) -> str:
        return f"Float8ShardedWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        source = None

        def unwrap(t: "Float8ShardedWeight") -> torch.Tensor:
            nonlocal source
            source = source or t._source
            return t._tensor

        args, kwargs = pytree.tree_map_only(Float8ShardedWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_WRAPPER:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: Float8ShardedWeight(t, source), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._source

    @staticmethod
    def __tensor_unflatten__(inner, source, outer_size, outer_stride):
        return Float8ShardedWeight(inner["_tensor"], source)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The shard in FP8 (as bytes: any backend gathers uint8) with the whole weight's scale."""
        scale = self._source.scale(self._tensor)
        data = quantize(self._tensor, scale, self._source.fp8_dtype).view(torch.uint8)
        rows = -(-outer_size[0] // mesh.shape[-1])  # FSDP2 gathers equal, padded shards (HSDP: the last dim)
        if data.shape[0] < rows:
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data,), (scale,)

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
                             out: torch.Tensor | None = None):
        """The gathered FP8 weight, seen as `param_dtype` (FSDP2 keeps `outputs` and refills them on
        every all-gather; later calls only pass the new scale)."""
        (data,), (scale,) = outputs, metadata
        data = data.view(self._source.fp8_dtype)
        if out is not None:
            local = out._local_tensor if hasattr(out, "_local_tensor") else out
            local._scale = scale
            return None
        return Float8GatheredWeight(data, scale, param_dtype), (data,)


class Float8GatheredWeight(torch.Tensor):
    """An unsharded weight held in FP8 (`_data`, `_scale`), seen as `dtype` [N, K]."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False):
        return _wrapper(cls, data, dtype, requires_grad)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False):
        self._data, self._scale = data, scale

    def __repr__(self) -> str:
        return f"Float8GatheredWeight({tuple(self.shape)}, {self._data.dtype}, scale={float(self._scale):.4g})"

    def dequantized(self) -> torch.Tensor:
        """The high-precision values this FP8 weight stands for."""
        return (self._data.to(accumulation_dtype(self.dtype)) / self._scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GATHERED_VIEWS and isinstance(args[0], Float8GatheredWeight):
            weight = args[0]
            data = func(weight._data, *args[1:], **kwargs)
            return Float8GatheredWeight(data, weight._scale, weight.dtype)
        # Anything else (printing, a norm, a non-FP8 use) sees the dequantized values.
        args, kwargs = pytree.tree_map_only(Float8GatheredWeight, lambda t: t.dequantized(), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Float8GatheredWeight(inner["_data"], inner["_scale"], dtype)


def gather_weight_in_fp8(module: torch.nn.Module, source: Float8GatherScale) -> None:
    """Makes `module.weight` (plain or a tensor-parallel DTensor, on any device incl. meta) a
    `Float8ShardedWeight`, before FSDP2 wraps the module, so FSDP2 gathers it in FP8."""
    from torch.distributed.tensor import DTensor

    weight = module.weight
    if isinstance(weight, DTensor):
        local = Float8ShardedWeight(weight.to_local().detach(), source)
        wrapped = DTensor.from_local(local, weight.device_mesh, weight.placements, shape=weight.shape,
                                     stride=weight.stride(), run_check=False)
    else:
        wrapped = Float8ShardedWeight(weight.detach(), source)
    module.weight = torch.nn.Parameter(wrapped, requires_grad=weight.requires_grad)
    module.register_state_dict_post_hook(_plain_weight)


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (a Float8ShardedWeight, or a DTensor of one) as the plain tensor it wraps, sharing
    its storage: what checkpoints save and load into."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor) and isinstance(tensor._local_tensor, Float8ShardedWeight):
        return DTensor.from_local(tensor._local_tensor._tensor, tensor.device_mesh, tensor.placements,
                                  shape=tensor.shape, stride=tensor.stride(), run_check=False)
    return tensor._tensor if isinstance(tensor, Float8ShardedWeight) else tensor


def _plain_weight(module, state_dict, prefix, local_metadata) -> None:
    """State-dict hook: checkpoints hold the weight as a plain tensor (loading copies into it in
    place, which reaches the wrapped shard), so nothing pickles the wrapper and its scale source."""
    key = f"{prefix}weight"
    if key in state_dict:
        state_dict[key] = plain(state_dict[key])
