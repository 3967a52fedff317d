"""Data parallelism as a pass: FSDP2 (ZeRO-3), HSDP, or DDP, with mixed precision."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.placements import REPLICATE, shard, shard_dim
from dtmega.passes.program import Program

MODES = ("fsdp", "hsdp", "ddp")
PARAM_DTYPES = ("float32", "bfloat16", "float16")
REDUCE_DTYPES = ("float32", "bfloat16")
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@dataclass
class DataParallel(Pass):
    """Replicates the model over the data-parallel axes and averages gradients.

    mode="fsdp": shard parameters, gradients and optimizer state over `dp_shard` (FSDP2,
    one unit per block plus the root). mode="hsdp": shard over `dp_shard`, replicate over
    `dp_replicate`. mode="ddp": replicate over all data-parallel ranks, all-reduce gradients.
    `param_dtype` is the compute dtype (bf16 mixed precision keeps fp32 master weights);
    `reduce_dtype` is the gradient-reduction dtype. Must be the last pass: it wraps the
    modules the other passes produced.
    """

    mode: str = "fsdp"
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    reshard_after_forward: bool | None = None
    blocks: str | None = None

    provides = ("data_parallel",)
    after = ("*",)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PlanError(f"DataParallel(mode={self.mode!r}) is unknown; use one of {MODES}")
        if self.param_dtype not in PARAM_DTYPES:
            raise PlanError(f"DataParallel(param_dtype={self.param_dtype!r}); use one of {PARAM_DTYPES}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise PlanError(f"DataParallel(reduce_dtype={self.reduce_dtype!r}); use one of {REDUCE_DTYPES}")

    def mesh_axes(self) -> tuple[str, ...]:
        return ("dp_shard",) if self.mode == "fsdp" else ("dp_replicate", "dp_shard")

    def annotate(self, program: Program) -> None:
        replicas = program.axis_size("dp_replicate")
        program.axis_size("dp_shard")  # the mesh must have it
        if self.mode == "fsdp" and replicas > 1:
            raise PlanError(
                f"DataParallel(mode='fsdp') shards over dp_shard only, but the mesh has dp_replicate="
                f"{replicas}. Fix: use mode='hsdp' (shard within, replicate across) or mode='ddp'"
            )
        if self.mode == "hsdp" and replicas == 1:
            raise PlanError(
                "DataParallel(mode='hsdp') needs dp_replicate > 1 in the mesh; with dp_replicate=1 "
                "it is plain FSDP. Fix: use mode='fsdp' or make_mesh(dp_replicate=...)"
            )
        experts = set(program.state.get("expert_parallel", {}).get("experts", ()))
        blocks = program.blocks(self.blocks)
        for fqn, param in program.layout.params():
            if self.mode == "ddp":
                continue
            module = fqn.rpartition(".")[0]
            if self.mode == "hsdp":
                param.placements["dp_replicate"] = REPLICATE
            # Dense weights shard over every rank with other tokens; experts (already split over
            # ep) over the ranks that hold the same experts.
            axes = self._shard_axes(program, expert=module in experts)
            dim = self._expert_shard_dim(program, param, axes) if module in experts else 0
            for axis in axes:
                param.placements[axis] = shard(dim)
        precision = f"param={_SHORT[self.param_dtype]} reduce={_SHORT[self.reduce_dtype]}"
        for fqn in [*experts, *blocks, ""]:
            entry = program.layout[fqn]
            entry.wrap = self.mode
            entry.precision = precision
        program.state["data_parallel"] = {"mode": self.mode, "size": program.data_size(context=False)}
        over = " x ".join(f"{axis}={program.mesh_shape[axis]}" for axis in program.data_axes() if
                          program.mesh_shape[axis] > 1) or "1 rank"
        program.note(f"DataParallel({self.mode}) over {over}, {len(blocks)} blocks + root"
                     + (f" + {len(experts)} expert groups" if experts else ""))

    @staticmethod
    def _expert_shard_dim(program: Program, param, axes: tuple[str, ...]) -> int:
        """Dim 0 (experts) when each FSDP rank gets at least one local expert; otherwise the
        first dim no other axis shards, so few experts over many ranks still split evenly."""
        local_experts = param.local_shape(program.mesh_shape)[0]
        ranks = 1
        for axis in axes:
            ranks *= program.mesh_shape[axis]
        if local_experts >= ranks:
            return 0
        taken = {shard_dim(p) for p in param.placements.values()}
        return next((d for d in range(1, len(param.shape)) if d not in taken), 0)

    def _placement_fn(self, program: Program, fqn: str, module):
        """FSDP's shard dim of each expert weight, as annotated (None: dim 0 for all)."""
        axis = self._shard_axes(program, expert=True)[0]
        entry = program.layout[fqn]
        dims = {id(param): shard_dim(entry.params[name].placement(axis)) or 0
                for name, param in module.named_parameters(recurse=False)}
        return (lambda param: Shard(dims.get(id(param), 0))) if any(dims.values()) else None

    def _shard_axes(self, program: Program, *, expert: bool) -> tuple[str, ...]:
        """The axes of size > 1 FSDP shards over (HSDP: within a replica); dp_shard if none."""
        axes = [axis for axis in program.data_axes() if axis != "dp_replicate" and program.mesh_shape[axis] > 1]
        return tuple(axis for axis in axes if not (expert and axis == "ep")) or ("dp_shard",)

    def _mesh(self, program: Program, *, expert: bool = False):
        # Context-parallel ranks hold the same weights and see other tokens: gradients are
        # averaged over them too (Megatron's dp_cp group). Experts are replicated only over the
        # ranks outside their expert-parallel group.
        shard_axes = self._shard_axes(program, expert=expert)
        if self.mode == "fsdp":
            return program.flat_submesh(shard_axes)
        if self.mode == "hsdp":
            if len(shard_axes) == 1:
                return program.submesh("dp_replicate", shard_axes[0])
            replicas = program.mesh_shape["dp_replicate"]
            flat = program.flat_submesh(("dp_replicate", *shard_axes))
            return flat._unflatten(0, (replicas, flat.size() // replicas), ("dp_replicate", "_".join(shard_axes)))
        return program.flat_submesh(("dp_replicate", *shard_axes))

    def apply(self, program: Program) -> None:
        policy = MixedPrecisionPolicy(
            param_dtype=None if self.param_dtype == "float32" else _dtype(self.param_dtype),
            reduce_dtype=_dtype(self.reduce_dtype),
        )
        experts = set(program.state.get("expert_parallel", {}).get("experts", ()))
        wrapped = [fqn for fqn, entry in program.layout.modules.items() if entry.wrap and fqn]
        wrapped.sort(key=lambda fqn: -fqn.count("."))  # inner units (experts) before their blocks
        reshard = self.reshard_after_forward
        if reshard is None and "pipeline" in program.state:
            reshard = False  # micro-batches would all-gather every block again and again
        kwargs = {} if reshard is None else {"reshard_after_forward": reshard}
        dense, expert_mesh = self._mesh(program), self._mesh(program, expert=True) if experts else None
        for fqn in [*wrapped, ""]:
            mesh = expert_mesh if fqn in experts else dense
            for module in program.modules_at(fqn):
                if self.mode == "ddp":
                    replicate(module, mesh=mesh, mp_policy=policy)
                else:
                    placement = self._placement_fn(program, fqn, module) if fqn in experts else None
                    fully_shard(module, mesh=mesh, mp_policy=policy, shard_placement_fn=placement, **kwargs)
                if fqn in experts:
                    # Expert gradients arrive summed over the expert-parallel group's tokens;
                    # averaging over every data rank (not only the replicas) gives the mean.
                    module.set_gradient_divide_factor(float(program.data_size()))
        backend = dist.get_backend(dense.get_group(0))
        if "nccl" not in backend:
            # gloo has no AVG/PREMUL_SUM reduction: reduce with SUM, then divide explicitly. Not
            # on expert units that shard over one rank (DDP's always do): there torch 2.13 divides
            # a custom divide factor out twice; unforced, it divides once and all-reduces with SUM.
            single = expert_mesh is not None and (self.mode == "ddp" or expert_mesh.size(expert_mesh.ndim - 1) == 1)
            for part in program.parts:
                for fqn, module in part.named_modules():
                    if isinstance(module, FSDPModule) and not (single and fqn in experts):
                        module.set_force_sum_reduction_for_comms(True)
