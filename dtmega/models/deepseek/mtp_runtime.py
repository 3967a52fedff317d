"""What `ParallelModel` does for DeepSeek's multi-token prediction: each depth's loss averaged
over the whole global batch's kept positions (as the next-token loss is), its value added to
the step's reported loss and kept for the log.

Per step: `shard_batch` counts each depth's kept positions (the loss mask rolled left by the
depth) over every data-parallel rank; `begin_step` gives the models the gradient scale of each
depth, ranks x loss_scale x mtp_loss_scaling_factor / (depths x count), the next-token loss's
per-token scale with the depth's own count; `extra_loss` sums the depths' recorded losses over
the ranks. Multi-token prediction is refused under tensor, context and pipeline parallelism
until its modules have rules there (a PlanError naming the fix, before any step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtmega.passes import Program
from dtmega.passes.errors import PlanError
from dtmega.passes.results import ContextSharding, PipelineStages, TensorParallelism
from dtmega.passes.runtime import Batch, RuntimeHook, StepContext


def mtp_hooks(program: Program) -> list[RuntimeHook]:
    """One MTPRuntime if the model predicts more than the next token."""
    parts = [part for part in program.parts if getattr(part, "mtp", None) is not None]
    if not parts:
        return []
    tensor, context, pipeline = (program.result(kind) for kind in (TensorParallelism, ContextSharding, PipelineStages))
    unsupported = [name for name, found in (
        ("tensor parallelism", tensor is not None and tensor.size > 1),
        ("context parallelism", context is not None and context.size > 1),
        ("pipeline parallelism", pipeline is not None and pipeline.stages > 1)) if found]
    if unsupported:
        raise PlanError(f"multi-token prediction (mtp_num_layers={parts[0].config.mtp_num_layers}) under "
                        f"{' and '.join(unsupported)} is not built yet. Fix: mtp_num_layers=0 (--mtp-num-layers 0), or "
                        "a plan of data and expert parallelism")
    return [MTPRuntime(program, parts)]


class MTPRuntime(RuntimeHook):
    """The MTP depths of this rank's model, wired to the data-parallel group."""

    def __init__(self, program: Program, parts: list):
        self.parts = parts
        config = parts[0].config
        self.depths, self.factor = config.mtp_num_layers, config.mtp_loss_scaling_factor / config.mtp_num_layers
        self.group = program.flat_submesh(program.data_axes()).get_group() if program.data_size() > 1 else None
        self.counts = torch.ones(self.depths)
        self.last_loss = torch.zeros(())
        self._before: list[dict] = []

    def _sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def shard_batch(self, batch: Batch) -> Batch:
        mask = batch.loss_mask.float()
        local = torch.stack([mask[:, depth:].sum() for depth in range(1, self.depths + 1)])
        self.counts = self._sum(local).cpu().clamp(min=1.0)
        return batch

    def begin_step(self, step: StepContext) -> None:
        scales = [step.ranks * step.loss_scale * self.factor / float(count) for count in self.counts]
        for part in self.parts:
            part.mtp_scales = scales
        self._before = [dict(part.mtp_stats) for part in self.parts]

    def extra_loss(self, step: StepContext) -> torch.Tensor:
        local = torch.zeros(self.depths)
        for part, before in zip(self.parts, self._before):
            for depth in range(1, self.depths + 1):
                key = f"sum{depth}"
                local[depth - 1] += float(part.mtp_stats.get(key, 0.0)) - float(before.get(key, 0.0))
        device = self.parts[0].rope_cache.device
        summed = self._sum(local.to(device)).cpu()
        loss = (summed / self.counts).sum() * self.factor
        self.last_loss = loss.detach()
        return loss.to(device)
