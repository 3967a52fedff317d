"""What `ParallelModel` does for DeepSeek's multi-token prediction: each depth's inputs rolled
over the whole sequence, each depth's loss averaged over the whole global batch's kept
positions (as the next-token loss is), its value added to the step's reported loss and kept
for the log.

Per step: `shard_batch` runs before every pass's hook (`runs_before_passes`), on this
data-parallel rank's whole sequences: it adds each depth's tokens, labels and loss mask rolled
left by the depth (`mtp_tokens_k`, `mtp_labels_k`, `mtp_mask_k`, so context parallelism cuts
them with the tokens and the shifted values cross its shard edges correctly, and a pipeline
carries them to its stages), and counts each depth's kept positions over the data-parallel
ranks. `begin_step` gives the models the gradient scale of each depth, ranks x loss_scale x
mtp_loss_scaling_factor / (depths x count), the next-token loss's per-token scale with the
depth's own count; `extra_loss` sums the depths' recorded losses over the ranks that hold
different tokens (data x context).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtmega.models.deepseek.model import roll_left
from dtmega.passes import Program
from dtmega.passes.results import PipelineStages
from dtmega.passes.runtime import Batch, RuntimeHook, StepContext

FIELDS = ("mtp_tokens", "mtp_labels", "mtp_mask")


def mtp_hooks(program: Program) -> list[RuntimeHook]:
    """One MTPRuntime if the model predicts more than the next token."""
    depths = program.facts.mtp_layers
    if not depths:
        return []
    return [MTPRuntime(program, depths)]


def mtp_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """The model's `mtp_tokens`, `mtp_labels`, `mtp_mask` ([B, S, depths]) from the batch's
    per-depth fields (none if the batch has none)."""
    depths = sum(1 for name in batch.extra if name.startswith("mtp_tokens_"))
    if not depths:
        return {}
    return {field: torch.stack([batch.extra[f"{field}_{d}"] for d in range(1, depths + 1)], dim=-1)
            for field in FIELDS}


class MTPRuntime(RuntimeHook):
    """The MTP depths of this rank's model, wired to the data-parallel group."""

    runs_before_passes = True  # rolls whole sequences, before context parallelism cuts them

    def __init__(self, program: Program, depths: int):
        self.parts = [part for part in program.parts if getattr(part, "mtp", None) is not None]
        config = program.parts[0].config
        self.depths, self.factor = depths, config.mtp_loss_scaling_factor / depths
        data = program.data_axes(context=False)  # counted on whole sequences: each data rank once
        self.count_group = program.flat_submesh(data).get_group() if data and program.flat_submesh(data).size() > 1 \
            else None
        self.sum_group = program.flat_submesh(program.data_axes()).get_group() if program.data_size() > 1 else None
        self.pipeline_group = program.submesh(program.result(PipelineStages).axis).get_group() \
            if program.result(PipelineStages) is not None else None
        self.first_part = program.parts[0]  # its buffers tell the device (after materialization)
        self.counts = torch.ones(self.depths)
        self.last_loss = torch.zeros(())
        self._before: list[dict] = []

    @staticmethod
    def _sum(tensor: torch.Tensor, group) -> torch.Tensor:
        if group is not None:
            dist.all_reduce(tensor, group=group)
        return tensor

    def shard_batch(self, batch: Batch) -> Batch:
        mask = batch.loss_mask.float()
        extra = dict(batch.extra)
        for depth in range(1, self.depths + 1):
            extra[f"mtp_tokens_{depth}"] = roll_left(batch.tokens, depth)
            extra[f"mtp_labels_{depth}"] = roll_left(batch.labels, depth)
            extra[f"mtp_mask_{depth}"] = roll_left(batch.loss_mask, depth)
        local = torch.stack([mask[:, depth:].sum() for depth in range(1, self.depths + 1)])
        self.counts = self._sum(local, self.count_group).cpu().clamp(min=1.0)
        return Batch(batch.tokens, batch.labels, batch.loss_mask, batch.position_ids, extra)

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
        device = self.first_part.rope_cache.device
        summed = self._sum(self._sum(local.to(device), self.sum_group), self.pipeline_group).cpu()
        loss = (summed / self.counts).sum() * self.factor
        self.last_loss = loss.detach()
        return loss.to(device)
