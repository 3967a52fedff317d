"""Running a pipeline-split model: torch's PipelineStages and schedules, one step at a time."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from dtmega.kernels.precision import accumulation_dtype
from dtmega.passes.errors import PlanError
from dtmega.passes.hidden_out import returns_hidden
from dtmega.passes.loss import Loss, plan_loss
from dtmega.passes.pipeline_forward import pipeline_forward
from dtmega.passes.program import Program
from dtmega.passes.results import PipelineStages
from dtmega.passes.runtime import Batch, Executor, StepContext


def check_microbatches(schedule: str, virtual_stages: int, microbatches: int, pp: int) -> None:
    """The schedule's demands on the number of micro-batches per step; PlanError naming the fix."""
    stages = pp * virtual_stages
    if microbatches < 1:
        raise PlanError(f"microbatches={microbatches} must be positive")
    if schedule in ("1f1b", "dualpipev") and microbatches < stages:
        raise PlanError(
            f"schedule {schedule!r} needs at least as many micro-batches as stages: {microbatches} < "
            f"{stages}. Fix: use >= {stages} micro-batches (a bigger batch or smaller micro-batches)"
        )
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise PlanError(
                f"schedule {schedule!r} needs the micro-batches ({microbatches}) to be a multiple of their "
                f"rounds ({rounds}); use a multiple of pp={pp}"
            )



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


class PipelineExecutor(Executor):
    """Runs a step through torch's PipelineStages and the plan's schedule (stages and schedules
    built on first use, after every pass has applied)."""

    def __init__(self, program: Program, local_stages: list[int], tied=None):
        self.program = program
        self.tied = tied  # TiedEmbeddingSync: the tied embedding's copies summed after backward
        self.info = program.require(PipelineStages, "PipelineExecutor")
        self.local_stages = local_stages
        self.mesh = program.submesh(self.info.axis)
        self.group = self.mesh.get_group()
        self.has_first = 0 in local_stages
        self.has_last = self.info.stages - 1 in local_stages
        self.step, self._unscaled = None, []  # the step being run; each micro-batch's unscaled loss
        self._stages: list[_Stage] | None = None
        self._schedules: dict[int, object] = {}
        self._plan_loss: Loss | None = None
        self._target_layout: tuple = ()

    def default_microbatches(self) -> int:
        return self.info.microbatches

    @property
    def logits_sharded(self) -> bool:
        """Whether the last stage's logits are vocab-sharded (tensor-parallel output layer)."""
        return any(e.style == "output" for e in self.program.layout.modules.values())

    @property
    def stages(self) -> list["_Stage"]:
        if self._stages is None:
            program = self.program
            device = torch.device(program.mesh.device_type, torch.cuda.current_device()) \
                if program.mesh.device_type == "cuda" else torch.device("cpu")
            self._stages = [_Stage(part, stage, self.info.stages, device, group=self.group)
                            for part, stage in zip(program.parts, self.local_stages)]
        return self._stages

    @property
    def loss(self) -> Loss:
        """The plan's loss (passes/loss.py): the same criterion every executor uses."""
        if self._plan_loss is None:
            self._plan_loss = plan_loss(self.program)
        return self._plan_loss

    def _stage_kwargs(self, position_ids: torch.Tensor | None, document_ids: torch.Tensor | None,
                      batch: Batch | None = None) -> dict:
        """What every stage's forward takes beside its input: position ids and, for packed
        documents, the document ids, and for a family whose model computes losses of its own the
        labels, loss mask and its other inputs (each micro-batch's own, cut by the schedule)."""
        family = self.program.family
        kwargs = {} if position_ids is None else {family.position_kwarg if family else "position_ids": position_ids}
        if document_ids is not None and family is not None and family.document_kwarg is not None:
            kwargs[family.document_kwarg] = document_ids
        if batch is not None and family is not None and family.loss_inputs:
            kwargs.update(labels=batch.labels, loss_mask=batch.loss_mask)
            if family.model_inputs is not None:
                kwargs.update(family.model_inputs(batch))
        return kwargs

    def logits(self, tokens: torch.Tensor, position_ids: torch.Tensor | None,
               document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The model's logits for `tokens` on every rank of the pipeline (vocab-sharded DTensor
        under tensor parallelism), without gradients: every rank passes the same tokens."""
        parts = dict(zip(self.local_stages, self.program.parts))
        logits = pipeline_forward(parts, self.info.rank_of_stage, self.group, tokens,
                                  self._stage_kwargs(position_ids, document_ids))
        if self.logits_sharded:
            logits = DTensor.from_local(logits, self.program.submesh(self.program.axes.name("tensor")), [Shard(-1)],
                                        run_check=False)
        return logits

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch: the plan's criterion over the stage's output
        (vocab-sharded logits come back as DTensors) and the micro-batch's loss fields."""
        if self.logits_sharded and not self.loss.hidden_out:
            tp_mesh = self.program.submesh(self.program.axes.name("tensor"))
            output = DTensor.from_local(output, tp_mesh, [Shard(-1)], run_check=False)
        batch = Batch.from_loss_target(target, self._target_layout)
        scale = self.step.scale_for(batch) if self.step is not None and self.step.train else 1.0
        loss = self.loss.criterion(self.stages[-1].submod, output, batch)
        self._unscaled.append(loss.detach())
        return loss * scale

    def schedule(self, microbatches: int):
        """The schedule for `microbatches` per step (built once per count)."""
        if microbatches not in self._schedules:
            check_microbatches(self.info.schedule, self.info.virtual_stages, microbatches, self.mesh.size())
            cls = get_schedule_class(self.info.torch_schedule)
            stages = self.stages[0] if issubclass(cls, PipelineScheduleSingle) else self.stages
            self._schedules[microbatches] = cls(stages, n_microbatches=microbatches, loss_fn=self._loss, scale_grads=False)
        return self._schedules[microbatches]

    def run(self, batch: Batch, step: StepContext, hooks: list) -> torch.Tensor:
        """One step (forward and, if training, backward) over the micro-batches; returns this
        rank's share of the summed, unscaled loss (non-zero only where the last stage lives)."""
        microbatches = step.microbatches
        if batch.tokens.shape[0] % microbatches:
            raise PlanError(
                f"a batch of {batch.tokens.shape[0]} sequences cannot be split into {microbatches} pipeline "
                f"micro-batches. Fix: make the batch size a multiple of {microbatches}"
            )
        self.step, self._unscaled = step, []  # _loss scales each micro-batch (a tensor: no host synchronization)
        schedule = self.schedule(microbatches)
        target, self._target_layout = batch.loss_target()
        kwargs = self._stage_kwargs(batch.position_ids, batch.extra.get("document_ids"), batch)
        losses: list[torch.Tensor] = []
        inputs = (batch.tokens,) if self.has_first else ()
        outputs = self.program.modules_at(self.program.facts.output) if self.loss.hidden_out else []
        with loss_parallel() if self.logits_sharded else contextlib.nullcontext(), returns_hidden(outputs):
            if step.train:
                schedule.step(*inputs, target=target, losses=losses, **kwargs)
                if self.tied is not None:
                    self.tied.sync()
            else:
                schedule.eval(*inputs, target=target, losses=losses, **kwargs)
        # Every stage reduces a scalar of the same dtype: fp32, or float64 for a float64 model.
        dtype = accumulation_dtype(next(self.program.parts[0].parameters()).dtype)
        total = torch.zeros((), dtype=dtype, device=batch.tokens.device)
        if self.has_last:  # the step's own micro-batches: the last ones (torch's shape inference may run one before)
            total = torch.stack(self._unscaled[-len(losses):]).sum().to(dtype)
        dist.all_reduce(total, group=self.group)
        return total
