"""Data parallelism as a pass: FSDP2 (ZeRO-3), HSDP, or DDP, with mixed precision."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.placements import REPLICATE, shard, shard_dim
from dtmega.passes.precision import LONG, SHORT, Precision
from dtmega.passes.program import Program
from dtmega.passes.results import DataParallelism, ExpertPlacement, PipelineStages
from dtmega.passes.runtime import RuntimeHook

MODES = ("fsdp", "hsdp", "ddp")
PARAM_DTYPES = ("float32", "bfloat16", "float16")
REDUCE_DTYPES = ("float32", "bfloat16")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@dataclass
class DataParallel(Pass):
    """Replicates the model over the data-parallel axes and averages gradients.

    mode="fsdp": shard parameters, gradients and optimizer state over `dp_shard` (FSDP2,
    one unit per block plus the root; or, where an earlier pass chose units with `wrap`,
    those plus the root). mode="hsdp": shard over `dp_shard`, replicate over
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
    shard_axis: str = "dp_shard"
    offload: bool = False  # fp32 weights, gradients and the optimizer's step on the host (--cpu-optimizer)
    replicate_axis: str = "dp_replicate"

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
        return (self.shard_axis,) if self.mode == "fsdp" else (self.replicate_axis, self.shard_axis)

    def roles(self) -> dict[str, str]:
        return {"data_shard": self.shard_axis, "data_replicate": self.replicate_axis}

    def annotate(self, program: Program) -> None:
        replicas = program.mesh_shape.get(self.replicate_axis, 1)
        program.axis_size(self.shard_axis)  # the mesh must have it
        if self.mode == "fsdp" and replicas > 1:
            raise PlanError(
                f"DataParallel(mode='fsdp') shards over {self.shard_axis} only, but the mesh has {self.replicate_axis}="
                f"{replicas}. Fix: use mode='hsdp' (shard within, replicate across) or mode='ddp'"
            )
        if self.mode == "hsdp" and replicas == 1:
            raise PlanError(
                f"DataParallel(mode='hsdp') needs {self.replicate_axis} > 1 in the mesh; with {self.replicate_axis}=1 "
                "it is plain FSDP. Fix: use mode='fsdp' or make_mesh(dp_replicate=...)"
            )
        if self.offload and self.mode == "ddp":
            raise PlanError("DataParallel(offload=True) keeps each rank's shard of the weights, gradients and optimizer "
                            "state on the host, which needs sharded data parallelism. Fix: mode='fsdp' (or 'hsdp'); "
                            "with flags, --use-distributed-optimizer with --cpu-optimizer")
        placement = program.result(ExpertPlacement)
        experts = set(placement.experts if placement else ())
        chosen = self._units_chosen_before(program)
        blocks = [fqn for fqn in chosen if fqn] or program.blocks(self.blocks)
        if program.data_size() == 1 and not self.offload and not chosen:
            self._annotate_one_rank(program)
            return
        for fqn, param in program.layout.params():
            if self.mode == "ddp":
                continue
            module = fqn.rpartition(".")[0]
            if self.mode == "hsdp":
                param.placements[self.replicate_axis] = REPLICATE
            # Dense weights shard over every rank with other tokens; experts (already split over
            # ep) over the ranks that hold the same experts.
            axes = self._shard_axes(program, expert=module in experts)
            dim = self._expert_shard_dim(program, param, axes) if module in experts else 0
            for axis in axes:
                param.placements[axis] = shard(dim)
        precision = Precision(param=SHORT[self.param_dtype], reduce=SHORT[self.reduce_dtype],
                              offload="cpu" if self.offload else None)
        for fqn in [*experts, *blocks, ""]:
            entry = program.layout[fqn]
            entry.wrap = self.mode
            entry.precision = precision
        program.record(DataParallelism(self.mode, program.data_size(context=False), self.shard_axis,
                                       self.replicate_axis))
        over = " x ".join(f"{axis}={program.mesh_shape[axis]}" for axis in program.data_axes() if
                          program.mesh_shape[axis] > 1) or "1 rank"
        units = f"{len(blocks)} units another pass chose" if any(chosen) else f"{len(blocks)} blocks"
        program.note(f"DataParallel({self.mode}) over {over}, {units} + root"
                     + (f" + {len(experts)} expert groups" if experts else ""))

    def _units_chosen_before(self, program: Program) -> list[str]:
        """The modules an earlier pass made data-parallel units (`wrap`), which this pass keeps
        as its units instead of every block ("FSDP only on the later blocks"; the root and the
        expert groups are units all the same). PlanError naming both passes and the module where
        they disagree: a unit of another mode, or this pass's own `blocks` choosing too."""
        chosen = [fqn for fqn, entry in program.layout.modules.items() if entry.wrap is not None]
        for fqn in chosen:
            wrap = program.layout[fqn].wrap
            owner = program.decided_by(fqn, "wrap") or "an earlier pass"
            if wrap != self.mode:
                fix = (f"DataParallel(mode={wrap!r}) (with flags, --data-parallel {wrap}), or" if wrap in MODES
                       else f"one of {MODES} from {owner}, or")
                raise PlanError(f"{owner} made {fqn or '<root>'} a {wrap!r} data-parallel unit, but DataParallel(mode="
                                f"{self.mode!r}) builds {self.mode!r} units: the two passes disagree on how "
                                f"{fqn or '<root>'} is wrapped. Fix: {fix} {owner} choosing {self.mode!r} units")
            if self.blocks is not None and fqn:
                raise PlanError(f"{owner} chose the data-parallel units ({fqn}, ...) and DataParallel(blocks="
                                f"{self.blocks!r}) chooses them too. Fix: leave blocks unset (the units {owner} "
                                "chose are kept), or drop the units from it")
        return chosen

    def _annotate_one_rank(self, program: Program) -> None:
        """One data-parallel rank: nothing to shard, replicate or reduce, so no FSDP/DDP unit
        (on one rank FSDP2 would still copy every weight in and every gradient out each step).
        Mixed precision becomes autocast around each forward, as in a plain script: fp32
        weights, gradients and optimizer state; matmuls in `param_dtype`."""
        program.layout[""].precision = (Precision(autocast=SHORT[self.param_dtype]) if self.param_dtype != "float32"
                                        else Precision(param="fp32"))
        program.record(DataParallelism(self.mode, 1, self.shard_axis, self.replicate_axis))
        program.note(f"DataParallel({self.mode}) over 1 rank: no wrapping"
                     + (f", autocast to {self.param_dtype}" if self.param_dtype != "float32" else ""))

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
        """The axes of size > 1 FSDP shards over (HSDP: within a replica); the shard axis if none."""
        expert_axis = program.axes.name("expert")
        axes = [axis for axis in program.data_axes() if axis != self.replicate_axis and program.mesh_shape[axis] > 1]
        return tuple(axis for axis in axes if not (expert and axis == expert_axis)) or (self.shard_axis,)

    def _mesh(self, program: Program, *, expert: bool = False):
        # Context-parallel ranks hold the same weights and see other tokens: gradients are
        # averaged over them too (Megatron's dp_cp group). Experts are replicated only over the
        # ranks outside their expert-parallel group.
        shard_axes = self._shard_axes(program, expert=expert)
        if self.mode == "fsdp":
            return program.flat_submesh(shard_axes)
        if self.mode == "hsdp":
            if len(shard_axes) == 1:
                return program.submesh(self.replicate_axis, shard_axes[0])
            replicas = program.mesh_shape[self.replicate_axis]
            flat = program.flat_submesh((self.replicate_axis, *shard_axes))
            return flat._unflatten(0, (replicas, flat.size() // replicas), (self.replicate_axis, "_".join(shard_axes)))
        return program.flat_submesh((self.replicate_axis, *shard_axes))

    def apply(self, program: Program) -> None:
        _tell_data_parallel_rank(program)
        if program.layout[""].wrap is None:  # one data-parallel rank and no unit chosen: no wrapping
            precision = program.layout[""].precision
            if precision is not None and precision.autocast:
                dtype = _dtype(self.param_dtype)
                for part in program.parts:
                    part.forward = torch.autocast(program.mesh.device_type, dtype=dtype)(part.forward)
            return
        placement = program.result(ExpertPlacement)
        experts = set(placement.experts if placement else ())
        wrapped = [fqn for fqn, entry in program.layout.modules.items() if entry.wrap and fqn]
        wrapped.sort(key=lambda fqn: -fqn.count("."))  # inner units (experts) before their blocks
        reshard = self.reshard_after_forward
        if reshard is None and program.result(PipelineStages) is not None:
            reshard = False  # micro-batches would all-gather every block again and again
        kwargs = {} if reshard is None else {"reshard_after_forward": reshard}
        dense, expert_mesh = self._mesh(program), self._mesh(program, expert=True) if experts else None
        for fqn in [*wrapped, ""]:
            mesh = expert_mesh if fqn in experts else dense
            policy = precision_policy(program.layout[fqn].precision)  # the unit's precision, as annotated
            for module in program.modules_at(fqn):
                if self.mode == "ddp":
                    replicate(module, mesh=mesh, mp_policy=policy)
                else:
                    placement = self._placement_fn(program, fqn, module) if fqn in experts else None
                    if self.offload:
                        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
                    fully_shard(module, mesh=mesh, mp_policy=policy, shard_placement_fn=placement, **kwargs)
                if fqn in experts:
                    # Expert gradients arrive summed over the expert-parallel group's tokens;
                    # averaging over every data rank (not only the replicas) gives the mean.
                    divide_expert_gradients(module, float(program.data_size()), mesh, self.mode, policy)
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
        program.add_hook(GradientSync(program.parts))


def divide_expert_gradients(module, factor: float, mesh, mode: str, policy: MixedPrecisionPolicy) -> None:
    """Has an expert unit's reduced gradients divided by `factor` once. FSDP's custom divide
    factor does that, except (torch 2.13, `foreach_reduce`) where the unit shards over one rank
    and reduces in a dtype other than fp32/bf16 (a float64 model, fp16 reductions): there it divides
    in its one-rank copy and again after the reduction, so the gradients came out `factor` times
    too small (found with float64 GPT experts under TP x EP: exactly half). Those units divide in
    the hook FSDP runs on the reduced gradient instead, once."""
    reduce_dtype = policy.reduce_dtype or next(module.parameters()).dtype
    one_rank = mode == "ddp" or mesh.size(mesh.ndim - 1) == 1
    if one_rank and reduce_dtype not in (torch.float32, torch.bfloat16):
        module.set_all_reduce_hook(lambda reduced: reduced.div_(factor))
    else:
        module.set_gradient_divide_factor(factor)


def precision_policy(precision: Precision | None) -> MixedPrecisionPolicy:
    """FSDP's mixed-precision policy from a layout entry's precision (param and reduce dtypes)."""
    param = LONG[precision.param] if precision and precision.param else "float32"
    reduce = LONG[precision.reduce] if precision and precision.reduce else "float32"
    if param == reduce == "float32":
        # No mixed precision: gradients reduce in the parameters' own dtype (fp32, or float64 for
        # a float64 model, which an fp32 reduction would silently round).
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=None if param == "float32" else _dtype(param), reduce_dtype=_dtype(reduce))


class GradientSync(RuntimeHook):
    """Gradient accumulation: the data-parallel roots reduce gradients only on the last
    micro-batch of a step (pipeline schedules manage their own)."""

    def __init__(self, parts):
        self.roots = [part for part in parts if isinstance(part, FSDPModule)]

    def gradient_sync(self, enabled: bool) -> None:
        for root in self.roots:
            root.set_requires_gradient_sync(enabled)


def _tell_data_parallel_rank(program: Program) -> None:
    """Gives every module that asks (`set_data_parallel_rank(rank, size)`: the GPT family's dropout,
    whose masks follow each sample's global index) this rank's share of the global batch."""
    askers = [m for part in program.parts for m in part.modules() if hasattr(m, "set_data_parallel_rank")]
    axes = [axis for axis in program.data_axes(context=False) if axis in program.mesh_shape]
    size = 1
    for axis in axes:
        size *= program.mesh_shape[axis]
    if not askers or size == 1:
        return
    rank = program.flat_submesh(tuple(axes)).get_local_rank()
    for module in askers:
        module.set_data_parallel_rank(rank, size)
