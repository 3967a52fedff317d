"""What `ParallelModel` does for the mixture-of-experts layers of dtmega models: which ranks'
tokens routing statistics are summed over, how the balancing losses' gradient is scaled like
the language-model loss, the expert-bias step, and the load statistics the trainer logs."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtmega.models.moe import MoE, moe_layers, update_expert_bias
from dtmega.models.router import TokenGroups
from dtmega.passes import Program
from dtmega.passes.results import ContextSharding, PipelineStages
from dtmega.passes.runtime import RuntimeHook, StepContext


def moe_hooks(program: Program) -> list[RuntimeHook]:
    """The dtmega model family's run-time hooks: one MoERuntime if the model has MoE layers."""
    runtime = MoERuntime(program)
    return [runtime] if runtime.layers else []


class MoERuntime(RuntimeHook):
    """The dtmega MoE layers on this rank, wired to the plan's process groups: the balancing
    losses scaled and added to the step's loss, the expert-bias step after the optimizer, and
    per-expert load statistics."""

    def __init__(self, program: Program):
        self.program = program
        self.layers: list[tuple[str, MoE]] = [item for part in program.parts for item in moe_layers(part)]
        self.batch_group = self.sequence_group = None
        self.last_loss = torch.zeros(())  # the balancing-loss part of the last step's loss
        self._before = torch.zeros(())
        if self.layers and program.mesh is not None:
            if program.data_size() > 1:
                self.batch_group = program.flat_submesh(program.data_axes()).get_group()
            context = program.result(ContextSharding)
            if context and context.size > 1:
                self.sequence_group = program.submesh(context.axis).get_group()
            for _, layer in self.layers:
                layer.groups = TokenGroups(self.batch_group, self.sequence_group)

    def __bool__(self) -> bool:
        return bool(self.layers)

    # ---- the RuntimeHook protocol -------------------------------------------------------------
    def begin_step(self, step: StepContext) -> None:
        # The balancing losses are per micro-batch: the objective averages them over the step's.
        self.set_loss_scale(step.ranks * step.loss_scale / step.microbatches)
        self._before = self.local_loss()

    def extra_loss(self, step: StepContext) -> torch.Tensor:
        loss = self.global_loss(self.local_loss() - self._before) / step.microbatches
        self.last_loss = loss.detach()
        return loss.to(self.program.mesh.device_type)

    def after_optimizer_step(self) -> None:
        self.update_expert_bias()

    def stats(self) -> dict:
        return {"moe": self.pop_stats()}

    def set_loss_scale(self, scale: float) -> None:
        """The gradient the balancing losses get (as the LM loss's per-token scale)."""
        for _, layer in self.layers:
            layer.loss_scale = scale

    def local_loss(self) -> torch.Tensor:
        """This rank's share of the balancing losses recorded so far (all layers, micro-batches)."""
        total = torch.zeros(())
        for _, layer in self.layers:
            if "loss" in layer.stats:
                total = total + layer.stats["loss"].detach().cpu()
        return total

    def _pipeline_group(self):
        pipeline = self.program.result(PipelineStages)
        return self.program.submesh(pipeline.axis).get_group() if pipeline else None

    def global_loss(self, local: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's share: the unsharded model's balancing losses."""
        for group in (self.batch_group, self._pipeline_group()):
            if group is not None:
                dist.all_reduce(local, group=group)
        return local

    def update_expert_bias(self) -> None:
        """DeepSeek-V3's bias step from the whole step's token counts on every data rank."""
        def summed(tensor: torch.Tensor) -> torch.Tensor:
            if self.batch_group is not None:
                dist.all_reduce(tensor, group=self.batch_group)
            return tensor

        for part in self.program.parts:
            update_expert_bias(part, summed)

    def pop_stats(self) -> dict:
        """Load statistics since the last call, over every rank (collective on every rank):
        per layer the fraction of routed assignments each expert got; the fraction dropped;
        the balancing loss (mean per recorded micro-batch step is the caller's business)."""
        per_layer, dropped, routed = {}, 0.0, 0.0
        for name, layer in self.layers:
            stats, layer.stats = layer.stats, {}
            if not stats:
                continue
            totals = torch.cat([stats["load"], stats["dropped"].view(1), stats["routed"].view(1)]).float()
            if self.batch_group is not None:
                dist.all_reduce(totals, group=self.batch_group)
            load = totals[:-2]
            per_layer[name] = (load / load.sum().clamp_min(1)).tolist()
            dropped, routed = dropped + float(totals[-2]), routed + float(totals[-1])
        pipeline = self._pipeline_group()
        if pipeline is not None:  # each stage holds other layers
            everyone: list = [None] * dist.get_world_size(pipeline)
            dist.all_gather_object(everyone, (per_layer, dropped, routed), group=pipeline)
            per_layer = {k: v for stage in everyone for k, v in stage[0].items()}
            dropped, routed = sum(stage[1] for stage in everyone), sum(stage[2] for stage in everyone)
        return {"expert_load": per_layer, "dropped_fraction": dropped / routed if routed else 0.0}
