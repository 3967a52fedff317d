"""Expert parallelism as a pass: the experts of every MoE layer are split over the `ep` axis and
tokens travel to the rank that holds their expert and back.

`ep` borrows data-parallel ranks (the batch is split over dp_replicate x dp_shard x ep), so the
router and every dense weight stay data-parallel over those ranks, while each expert lives on
one ep rank and is data-parallel over the ranks outside its ep group (Megatron's
expert-data-parallel group), which `DataParallel` wraps separately.

`fold=("tp",)` is Megatron's MoE parallel folding with expert tensor parallelism 1: the experts
are spread whole over ep x tp ranks (each TP rank sends its share of the tokens, kernels/moe_fold.py)
instead of each expert's hidden dim being split over tp; TensorParallel(expert_hidden=False)
leaves them to this pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from dtmega.kernels.context_shards import CommStats
from dtmega.kernels.moe_dispatch import DISPATCHERS, AllGatherDispatcher, AllToAllDispatcher, FlexDispatcher
from dtmega.kernels.moe_fold import FoldedDispatcher
from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.placements import shard, shard_dim
from dtmega.passes.program import Program
from dtmega.passes.results import DataParallelism, ExpertPlacement
from dtmega.passes.runtime import RuntimeHook


@dataclass
class ExpertParallel(Pass):
    """Shards every MoE layer's experts over `axis` and dispatches tokens with
    `dispatcher` = "alltoall" (uneven all-to-all of the routed tokens) or "allgather" (every rank
    sees the group's tokens and computes its experts' share). The router stays replicated. Under
    TensorParallel the experts are also split on their hidden dim (expert tensor parallelism =
    TP, Megatron's default), unless `fold` names the tensor axis: then they are spread whole over
    ep x tp (ETP 1). Needs a DataParallel pass: ep ranks see different tokens."""

    axis: str = "ep"
    dispatcher: str = "alltoall"
    fold: tuple[str, ...] = ()

    provides = ("expert_parallel@{axis}",)
    role = "expert"
    after = ("tensor_parallel@*", "sequence_parallel@*")

    def __post_init__(self) -> None:
        self.fold = tuple(self.fold)  # a TOML plan gives a list

    def annotate(self, program: Program) -> None:
        size = program.axis_size(self.axis) * self._fold_size(program)
        if self.dispatcher not in DISPATCHERS:
            raise PlanError(f"ExpertParallel(dispatcher={self.dispatcher!r}) is unknown; use one of {DISPATCHERS}")
        family = program.family
        moe = program.facts.moe if family is not None else None
        if moe is None or family.install_dispatcher is None:
            raise PlanError(
                f"ExpertParallel cannot find the router and experts of {type(program.model).__name__}: "
                + ("no registered model family knows it" if family is None else
                   f"its family ({family.name}) names no mixture-of-experts layers")
                + ". Fix: build the model with MoE layers, or register a family whose facts describe them "
                "(ModelFacts.moe and ModelFamily.install_dispatcher)"
            )
        if not 1 <= moe.top_k <= moe.num_experts:
            raise PlanError(
                f"the model routes each token to top_k={moe.top_k} of {moe.num_experts} experts; top_k must be "
                "between 1 and num_experts. Fix: the model's MoE config"
            )
        if moe.num_experts % size:
            raise PlanError(
                f"num_experts={moe.num_experts} is not divisible by {self._spread(program)}={size}: every expert-parallel rank "
                f"holds the same number of experts. Fix: use {self.axis} in "
                f"{[d for d in range(1, moe.num_experts + 1) if moe.num_experts % d == 0]}"
            )
        groups = moe.num_groups
        if groups and size > 1 and groups % size and size % groups:
            per_group = moe.num_experts // groups
            raise PlanError(
                f"group-limited routing puts the experts in {groups} groups of {per_group}, which do not map onto "
                f"{self.axis}={size} ranks (each rank must hold whole groups, or each group whole ranks), so it could "
                f"not bound the ranks a token reaches. Fix: {self.axis} dividing {groups} or a multiple of it, e.g. "
                f"{[d for d in range(1, groups + 1) if groups % d == 0]}"
            )
        experts = []
        for layer in moe.layers:
            for fqn in (f"{layer}.{moe.router}", moe.experts_at(layer)):
                if fqn not in program.layout:
                    raise PlanError(f"ExpertParallel expected {fqn!r} in {type(program.model).__name__}; none found")
            entry = program.layout[moe.experts_at(layer)]
            for name in moe.expert_params:
                for axis in self.fold:
                    if shard_dim(entry.params[name].placement(axis)) is not None:
                        raise PlanError(
                            f"ExpertParallel(fold={self.fold}) spreads the experts of {moe.experts_at(layer)} whole over "
                            f"{axis!r}, but an earlier pass already placed {name} on it ({entry.params[name].placement(axis)}, "
                            "TensorParallel's expert hidden-dim split). Fix: TensorParallel(expert_hidden=False) with "
                            "the fold, or no fold (experts split on their hidden dim, ETP = TP)"
                        )
                entry.params[name].placements[self.axis] = shard(0)
                for axis in self.fold:
                    entry.params[name].placements[axis] = shard(0)
            entry.kernel = f"moe.dispatch.{self.dispatcher}"
            entry.options = {**entry.options, "expert_parallel": True}
            experts.append(moe.experts_at(layer))
        program.record(ExpertPlacement(self.axis, program.axis_size(self.axis), tuple(experts), self.dispatcher,
                                       self.fold))
        bound = ""
        if groups and size > 1:
            bound = f"; groups on ranks: a token reaches at most {min(size, moe.group_topk * max(1, size // groups))}"
        program.note(f"ExpertParallel({self.dispatcher}, {self._spread(program)}={size}): {moe.num_experts // size} of "
                     f"{moe.num_experts} experts per rank in {len(moe.layers)} layers{bound}")

    def _fold_size(self, program: Program) -> int:
        tensor = program.axes.name("tensor")
        for axis in self.fold:
            if axis != tensor:
                raise PlanError(
                    f"ExpertParallel(fold={self.fold}): only the tensor axis ({tensor!r}) can be folded into expert "
                    f"parallelism (its ranks hold the same tokens before the experts; {axis!r}'s do not). Fix: "
                    f"fold=({tensor!r},) or fold=()"
                )
        return program.axis_size(tensor) if self.fold else 1

    def _spread(self, program: Program) -> str:
        return " x ".join((self.axis, *self.fold))

    def finalize(self, program: Program) -> None:
        if program.axis_size(self.axis) > 1 and program.result(DataParallelism) is None:
            raise PlanError(
                f"ExpertParallel borrows data-parallel ranks ({self.axis} ranks see different tokens), whose dense "
                "gradients must then be averaged: add DataParallel('fsdp') (or 'ddp'/'hsdp') to the plan"
            )

    def apply(self, program: Program) -> None:
        moe = program.facts.moe
        stats = CommStats()
        program.add_hook(ExpertDispatch(stats))
        group = program.flat_submesh((self.axis, *self.fold)).get_group()
        make = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher, "flex": FlexDispatcher}[self.dispatcher]
        for layer in moe.layers:
            for module in program.modules_at(layer):
                dispatcher = make(moe.num_experts, group, stats)
                if self.fold and program.axis_size(self.fold[0]) > 1:
                    dispatcher = FoldedDispatcher(dispatcher, program.submesh(self.fold[0]))
                program.family.install_dispatcher(module, dispatcher)
            entry = program.layout[moe.experts_at(layer)]
            for experts in program.modules_at(moe.experts_at(layer)):
                self._distribute(program, experts, entry)

    def _distribute(self, program: Program, experts: nn.Module, entry) -> None:
        """Shards the expert weights over ep (and tp, where expert tensor parallelism applies)."""
        for name, layout in entry.params.items():
            tensor = program.axes.name("tensor")
            axes = [axis for axis in (self.axis, tensor) if shard_dim(layout.placement(axis)) is not None]
            mesh = program.submesh(*axes)
            param = getattr(experts, name)
            placements = [Shard(shard_dim(layout.placements[axis])) for axis in mesh.mesh_dim_names]
            sharded = distribute_tensor(param.data, mesh, placements, src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            if tensor in axes and tensor not in self.fold:  # the hidden dim split over tp (ETP = TP)
                experts.tp_mesh = program.submesh(tensor)


class ExpertDispatch(RuntimeHook):
    """The token dispatchers' traffic: `comm` counts what they sent."""

    def __init__(self, comm: CommStats):
        self.comm = comm
