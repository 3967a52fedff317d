"""Running a pipeline-split model: torch's PipelineStages and schedules, one step at a time."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from dtmega.batch import Batch
from dtmega.kernels import per_token_cross_entropy
from dtmega.passes import Program


class PipelineParts(nn.Module):
    """This rank's stages seen as one module with the unsharded model's FQNs, for optimizers,
    state dicts and checkpoints (the stages themselves run separately)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        for part in parts:
            if any(True for _ in part.named_parameters(recurse=False)):
                raise ValueError("a pipeline stage with parameters directly on its root cannot be merged")
            for name, child in part.named_children():
                if child is None:
                    continue
                if isinstance(child, nn.ModuleDict):
                    merged = self._modules.setdefault(name, nn.ModuleDict())
                    for key, module in child.items():
                        merged[key] = module
                elif name in self._modules and self._modules[name] is not child:
                    raise ValueError(f"two local stages both hold {name!r}")
                else:
                    self._modules[name] = child

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline-parallel model runs through ParallelModel.forward_backward / loss_sum")


@contextlib.contextmanager
def _not_counting(module: nn.Module):
    """Layers that keep training statistics (MoE routing) skip the forwards run inside."""
    counting = [m for m in module.modules() if getattr(m, "counting", False)]
    for m in counting:
        m.counting = False
    try:
        yield
    finally:
        for m in counting:
            m.counting = True


class _Stage(PipelineStage):
    """A PipelineStage whose metadata inference (a forward and backward on stand-in tensors,
    run before the first step and after every eval/train switch) leaves no trace in the
    model's statistics."""

    def _prepare_forward_infra(self, *args, **kwargs):
        with _not_counting(self.submod):
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args, **kwargs):
        with _not_counting(self.submod):
            return super()._prepare_backward_infra(*args, **kwargs)


class PipelineRuntime:
    """Builds this rank's PipelineStages and, per micro-batch count, the plan's schedule."""

    def __init__(self, program: Program, logits_sharded: bool, pipeline_kwargs: Callable):
        self.program = program
        info = program.state["pipeline"]
        self.info = info
        self.mesh = program.submesh(info["axis"])
        self.group = self.mesh.get_group()
        device = torch.device(program.mesh.device_type, torch.cuda.current_device()) \
            if program.mesh.device_type == "cuda" else torch.device("cpu")
        self.stages = [
            _Stage(part, stage, info["stages"], device, group=self.group)
            for part, stage in zip(program.parts, info["local_stages"])
        ]
        self.has_first = 0 in info["local_stages"]
        self.has_last = info["stages"] - 1 in info["local_stages"]
        self.logits_sharded = logits_sharded
        self.tp_mesh = program.submesh("tp") if logits_sharded else None
        self.pipeline_kwargs = pipeline_kwargs
        self.scale = 1.0
        self._schedules: dict[int, object] = {}

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = DTensor.from_local(output, self.tp_mesh, [Shard(-1)], run_check=False) if self.logits_sharded else output
        losses = per_token_cross_entropy(logits, target[..., 0].long())
        return (losses * target[..., 1].float()).sum() * self.scale

    def schedule(self, microbatches: int):
        """The schedule for `microbatches` per step (built once per count)."""
        if microbatches not in self._schedules:
            self.info["split"].check_microbatches(microbatches, self.mesh.size())
            cls = get_schedule_class(self.info["torch_schedule"])
            stages = self.stages[0] if issubclass(cls, PipelineScheduleSingle) else self.stages
            self._schedules[microbatches] = cls(stages, n_microbatches=microbatches, loss_fn=self._loss, scale_grads=False)
        return self._schedules[microbatches]

    def _context(self):
        return loss_parallel() if self.logits_sharded else contextlib.nullcontext()

    def run(self, batch: Batch, microbatches: int, scale: float, train: bool = True) -> torch.Tensor:
        """One step (forward and, if `train`, backward) over `microbatches`; returns this rank's
        share of the summed, unscaled loss (non-zero only where the last stage lives)."""
        if batch.tokens.shape[0] % microbatches:
            raise ValueError(
                f"a batch of {batch.tokens.shape[0]} sequences cannot be split into {microbatches} pipeline "
                f"micro-batches. Fix: make the batch size a multiple of {microbatches}"
            )
        self.scale = scale
        schedule = self.schedule(microbatches)
        target = torch.stack([batch.labels.double(), batch.loss_mask.double()], dim=-1)
        kwargs = self.pipeline_kwargs(batch.position_ids)
        losses: list[torch.Tensor] = []
        inputs = (batch.tokens,) if self.has_first else ()
        with self._context():
            if train:
                schedule.step(*inputs, target=target, losses=losses, **kwargs)
            else:
                schedule.eval(*inputs, target=target, losses=losses, **kwargs)
        total = torch.zeros((), device=batch.tokens.device)
        if self.has_last:
            total = torch.stack([loss.detach() for loss in losses]).sum() / scale
        dist.all_reduce(total, group=self.group)
        return total
