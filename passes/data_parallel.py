"""Data parallelism as a pass: FSDP2 (ZeRO-3), HSDP, or DDP, with mixed precision."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.placements import REPLICATE, shard
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
        shards = program.axis_size("dp_shard")
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
        context = program.axis_size("cp") if "context_parallel" in program.state else 1
        blocks = program.blocks(self.blocks)
        for fqn, param in program.layout.params():
            if self.mode in ("fsdp", "hsdp"):
                if self.mode == "hsdp":
                    param.placements["dp_replicate"] = REPLICATE
                param.placements["dp_shard"] = shard(0)
                if context > 1:  # FSDP shards over dp_shard x cp, one flattened axis
                    param.placements["cp"] = shard(0)
        precision = f"param={_SHORT[self.param_dtype]} reduce={_SHORT[self.reduce_dtype]}"
        for fqn in [*blocks, ""]:
            entry = program.layout[fqn]
            entry.wrap = self.mode
            entry.precision = precision
        program.state["data_parallel"] = {"mode": self.mode, "size": replicas * shards, "cp": context}
        program.note(f"DataParallel({self.mode}) over {replicas}x{shards}" + (f"x{context} (cp)" if context > 1 else "")
                     + f" ranks, {len(blocks)} blocks + root")

    def _mesh(self, program: Program):
        # Context-parallel ranks hold the same parameters and see different tokens: gradients
        # are averaged over them too, as Megatron's dp_cp group does.
        context = program.state["data_parallel"]["cp"] > 1
        if self.mode == "fsdp":
            return program.submesh("dp_shard", "cp", flatten="dp_shard_cp") if context else program.submesh("dp_shard")
        if self.mode == "hsdp" and context:  # replicate x (dp_shard x cp)
            replicas = program.mesh_shape["dp_replicate"]
            flat = program.submesh("dp_replicate", "dp_shard", "cp", flatten="dp_cp")
            return flat._unflatten(0, (replicas, flat.size() // replicas), ("dp_replicate", "dp_shard_cp"))
        if self.mode == "hsdp":
            return program.submesh("dp_replicate", "dp_shard")
        if context:
            return program.submesh("dp_replicate", "dp_shard", "cp", flatten="dp_cp")
        return program.submesh("dp_replicate", "dp_shard", flatten="dp")

    def apply(self, program: Program) -> None:
        mesh = self._mesh(program)
        policy = MixedPrecisionPolicy(
            param_dtype=None if self.param_dtype == "float32" else _dtype(self.param_dtype),
            reduce_dtype=_dtype(self.reduce_dtype),
        )
        wrapped = [fqn for fqn, entry in program.layout.modules.items() if entry.wrap and fqn]
        reshard = self.reshard_after_forward
        if reshard is None and "pipeline" in program.state:
            reshard = False  # micro-batches would all-gather every block again and again
        kwargs = {} if reshard is None else {"reshard_after_forward": reshard}
        for fqn in [*wrapped, ""]:
            for module in program.modules_at(fqn):
                if self.mode == "ddp":
                    replicate(module, mesh=mesh, mp_policy=policy)
                else:
                    fully_shard(module, mesh=mesh, mp_policy=policy, **kwargs)
        backend = dist.get_backend(mesh.get_group(0))
        if "nccl" not in backend:
            # gloo has no AVG/PREMUL_SUM reduction: reduce with SUM, then divide explicitly.
            for part in program.parts:
                for module in part.modules():
                    if isinstance(module, FSDPModule):
                        module.set_force_sum_reduction_for_comms(True)
