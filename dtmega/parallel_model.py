"""ParallelModel: what `parallelize` returns. One `forward_backward` for every plan: the passes
leave typed results, runtime hooks and (pipelines) an executor in the program
(passes/runtime.py); this class only runs them, so a new pass needs no edit here."""

from __future__ import annotations

import torch
import torch.distributed as dist
from rich.table import Table
from tensordict import TensorDict
from torch import nn

from dtmega.batch import unpack_batch
from dtmega.compile_guard import refuse_whole_step_compile
from dtmega.kernels.errors import DtmegaError
from dtmega.model_weights import ModelWeights
from dtmega.passes import Layout, Plan, PlanError, Program
from dtmega.passes.families import default_logits
from dtmega.passes.loss import document_kwargs, loss_for, plan_loss
from dtmega.passes.pipeline_runtime import PipelineParts
from dtmega.passes.pipeline_table import schedule_table
from dtmega.passes.render import layout_table
from dtmega.passes.results import PipelineStages
from dtmega.passes.runtime import AVERAGING, Batch, MicrobatchLoop, RuntimeHook, StepContext


class ParallelModel(ModelWeights):
    """A model sharded by a plan: the transformed `module`, its `layout`, and a training step.
    `forward_backward(batch)` takes this data-parallel rank's batch, accumulates gradients and
    returns the *global* batch's token-weighted mean loss (the same on every rank), exactly as
    the unsharded model computes it on the concatenated batch."""

    def __init__(self, program: Program, plan: Plan):
        self.program, self.plan = program, plan
        tied = getattr(program.executor, "tied", None)
        if tied is not None:  # the last stage's copy of a tied embedding, as the applied plan left it
            tied.mark()
        parts = program.parts
        self._module = parts[0] if len(parts) == 1 else PipelineParts(parts)
        family = program.family
        own = family.runtime_hooks(program) if family is not None and family.runtime_hooks is not None else []
        self.hooks: list[RuntimeHook] = ([hook for hook in own if hook.runs_before_passes] + list(program.hooks)
                                         + [hook for hook in own if not hook.runs_before_passes])
        self.executor = program.executor or MicrobatchLoop(self._module, loss_for(program))
        self._data_group = None  # the data (x context) ranks' group, for the step's sums
        # the per-token fields beyond the four every batch has that the plan's passes and loss read
        self.batch_fields = tuple(dict.fromkeys(
            [name for p in plan.passes for name in p.batch_fields]
            + list(plan_loss(program).fields if program.family is not None else ())))

    # ---- what the plan produced ---------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The sharded nn.Module (parameters are DTensors where a pass sharded them). Under
        pipeline parallelism: this rank's stages as one module with the unsharded FQNs."""
        return self._module

    @property
    def parts(self) -> list[nn.Module]:
        """The modules this rank runs: the model, or its local pipeline stages."""
        return list(self.program.parts)

    @property
    def layout(self) -> Layout:
        """Every module's placements, stage, recompute, kernel and precision."""
        return self.program.layout

    @property
    def mesh(self):
        """The DeviceMesh the model is sharded over."""
        return self.program.mesh

    @property
    def log(self) -> list[str]:
        """What each pass did, in order."""
        return list(self.program.log)

    def result(self, kind):
        """The typed result a pass recorded (e.g. `pm.result(PipelineStages)`), or None."""
        return self.program.result(kind)

    def hook(self, kind):
        """The runtime hook of type `kind` (e.g. the MoE runtime), or None."""
        return next((h for h in self.hooks if isinstance(h, kind)), None)

    @property
    def pipelined(self) -> bool:
        """True if the plan split the model into pipeline stages."""
        return self.result(PipelineStages) is not None

    def pipeline_group(self):
        """The pipeline-parallel process group (None without pipelining)."""
        return self.executor.group

    def schedule_table(self, microbatches: int | None = None) -> Table:
        """The schedule's actions per rank per tick (F forward, B backward, I input-grad,
        W weight-grad; the number is the micro-batch, s the stage) as a rich table."""
        if not self.pipelined:
            raise RuntimeError("this plan has no PipelineSplit")
        schedule = self.executor.schedule(microbatches or self.executor.default_microbatches())
        return schedule_table(schedule, self.result(PipelineStages))

    def report(self, *, fold: bool = True) -> Table:
        """A rich table of the layout with bytes per rank (`dtmega.console().print(pm.report())`);
        with a workload given to `parallelize`, the predicted per-rank budget below it (memory by
        purpose, FLOPs, bytes per collective, and step time if a hardware was given)."""
        mesh = " x ".join(f"{axis}={size}" for axis, size in self.layout.mesh.items() if size > 1) or "1 rank"
        table = layout_table(self.layout, fold=fold, title=f"{self.layout[''].type} on {mesh}")
        if self.layout.cost is None:
            return table
        both = Table.grid()
        both.add_row(table)
        both.add_row(self.layout.cost.table())
        both.caption = table.caption
        return both

    def parameters(self):
        """The (sharded) parameters, for the optimizer."""
        return self.module.parameters()

    def named_parameters(self):
        """(name, sharded parameter) pairs; names are the unsharded model's."""
        return self.module.named_parameters()

    def train(self, mode: bool = True) -> "ParallelModel":
        self.module.train(mode)
        return self

    def eval(self) -> "ParallelModel":
        return self.train(False)

    # ---- data-parallel coordinates ------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks (replicate x shard x expert): the batch splits over them."""
        return self.program.data_size(context=False)

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks."""
        return self.program.flat_submesh(self.program.data_axes(context=False)).get_local_rank() if self.dp_size > 1 else 0

    def shard_batch(self, global_batch: TensorDict) -> TensorDict:
        """This data-parallel rank's slice of a global batch (every rank passes the same one)."""
        size = global_batch.batch_size[0]
        if size % self.dp_size:
            raise PlanError(
                f"a global batch of {size} sequences does not split over {self.dp_size} data-parallel "
                f"ranks. Fix: use a batch size that is a multiple of {self.dp_size}"
            )
        return global_batch.chunk(self.dp_size, dim=0)[self.dp_rank]

    # ---- compute ------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `tokens` (vocab-sharded DTensor under tensor parallelism) under every plan.
        Under context parallelism each rank computes its part of every sequence and every rank
        gets the whole; under pipeline parallelism every rank passes the same tokens, the stages
        run in turn without gradients and every rank gets the last stage's logits."""
        # the hooks cut the tokens as for a step (context parallelism: this rank's part of each
        # sequence, global positions) and put the logits back together
        fields = Batch(tokens, tokens, torch.ones_like(tokens), position_ids,
                       {} if document_ids is None else {"document_ids": document_ids})
        for hook in self.hooks:
            fields = hook.shard_batch(fields)
        if self.pipelined:
            logits = self.executor.logits(fields.tokens, fields.position_ids, fields.extra.get("document_ids"))
            self.reshard()
        else:
            logits_fn = self.program.family.logits if self.program.family else default_logits
            logits = logits_fn(self.module, fields.tokens, fields.position_ids,
                               **document_kwargs(fields, self.program.family, loss_inputs=False))
        for hook in reversed(self.hooks):
            logits = hook.unshard_output(logits)
        return logits

    __call__ = forward

    def _data_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sums over every rank that holds different tokens of the global batch (data x context)."""
        if self.program.data_size() > 1:
            if self._data_group is None:  # found once: flattening a mesh reads its rank tensor on the host
                self._data_group = self.program.flat_submesh(self.program.data_axes()).get_group()
            dist.all_reduce(value, group=self._data_group)
        return value

    def prepare_batch(self, batch: TensorDict) -> Batch:
        """This rank's part of its batch as the step sees it: validated, sharded by the hooks."""
        fields = unpack_batch(batch, self.program.facts.vocab_size if self.program.family else None, self.batch_fields)
        for hook in self.hooks:
            fields = hook.shard_batch(fields)
        return fields

    def _step(self, fields: Batch, microbatches: int | None, loss_scale: float, train: bool,
              averaging: str = "tokens") -> tuple:
        tokens = self._data_sum(fields.loss_mask.sum().to(torch.float32))
        if tokens.device.type == "cuda":  # checked on the device: no host synchronization
            torch._assert_async(tokens > 0, "the global batch has no token with loss_mask=1")
        elif float(tokens) == 0:
            raise DtmegaError("the global batch has no token with loss_mask=1; nothing to learn from")
        ranks = self.program.data_size()
        if averaging not in AVERAGING:
            raise PlanError(f"averaging={averaging!r}: choose one of {', '.join(AVERAGING)}")
        step = StepContext(microbatches or self.executor.default_microbatches(), loss_scale, ranks,
                           ranks * loss_scale / tokens, train, averaging)
        return step, tokens

    def forward_backward(self, batch: TensorDict, microbatches: int | None = None,
                         loss_scale: float = 1.0, averaging: str = "tokens") -> torch.Tensor:
        """Forward and backward over this rank's `batch`, split into `microbatches` (gradient
        accumulation; the pipeline's micro-batches under pipeline parallelism, by default the
        plan's); returns the detached global token-weighted mean loss. Gradients are those of
        `loss_scale` x the loss (fp16 loss scaling), averaged as `averaging` says: "tokens", the
        global token-weighted mean (the unsharded model's loss; Megatron's
        --calculate-per-token-loss), or "microbatches", each micro-batch's token mean on each
        rank averaged over micro-batches and data-parallel ranks (Megatron's default). Not for
        `torch.compile` (PlanError naming `Compile()` and `dtmega.capture_step`, which compile
        what can be)."""
        refuse_whole_step_compile("forward_backward")
        fields, step, tokens = self.begin_step(batch, microbatches, loss_scale, averaging)
        return self.run_step(fields, step, tokens)

    def begin_step(self, batch: TensorDict, microbatches: int | None = None,
                   loss_scale: float = 1.0, averaging: str = "tokens") -> tuple[Batch, StepContext, torch.Tensor]:
        """A training step's host side: this rank's batch validated and cut by the hooks, the
        global number of loss tokens, and each hook told the step begins. `run_step` is the
        rest; `forward_backward` is both (dtmega.step_capture compiles `run_step` alone)."""
        refuse_whole_step_compile("begin_step")
        fields = self.prepare_batch(batch)
        step, tokens = self._step(fields, microbatches, loss_scale, train=True, averaging=averaging)
        for hook in self.hooks:
            hook.begin_step(step)
        return fields, step, tokens

    def run_step(self, fields: Batch, step: StepContext, tokens: torch.Tensor) -> torch.Tensor:
        """A training step's device side after `begin_step`: forward and backward over every
        micro-batch, the global mean loss (plus the hooks' extra losses)."""
        loss = self._data_sum(self.executor.run(fields, step, self.hooks)) / tokens
        for hook in self.hooks:
            extra = hook.extra_loss(step)
            loss = loss if extra is None else loss + extra
        return loss

    @torch.no_grad()
    def loss_sum(self, batch: TensorDict, microbatches: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, number of loss tokens) of the *global* batch this rank's `batch` is part
        of, without gradients: for validation, where batches are averaged by tokens. `batch` is
        run in `microbatches` pieces (None: as a training step's)."""
        refuse_whole_step_compile("loss_sum")
        fields = self.prepare_batch(batch)
        step, tokens = self._step(fields, microbatches, 1.0, train=False)
        total = self._data_sum(self.executor.run(fields, step, self.hooks))
        self.reshard()
        return total, tokens

    def after_optimizer_step(self) -> None:
        """After `optimizer.step()`: what the plan's passes and the model do then (MoE expert
        bias, auxiliary-loss-free balancing; FP8 scale updates). Collective."""
        for hook in self.hooks:
            hook.after_optimizer_step()


    def stats(self) -> dict:
        """Every hook's statistics since the last call (collective: call on every rank)."""
        return {key: value for hook in self.hooks for key, value in hook.stats().items()}

    def moe_stats(self) -> dict:
        """Per-layer expert load and dropped fraction since the last call (collective)."""
        return self.stats().get("moe", {"expert_load": {}, "dropped_fraction": 0.0})

    def compile(self, **kwargs) -> "ParallelModel":
        """Refused: compiling is a plan decision. `Compile(...)` as the plan's last pass runs the
        manager's order checks and every pass's `finalize` (FuseKernels hands norms, SwiGLU and
        RoPE back to inductor inside compiled blocks on GPUs), which a shortcut after `apply`
        would skip, leaving another layout than the same plan with the pass."""
        arguments = ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
        raise PlanError(f"pm.compile({arguments}): compiling is a pass: add Compile({arguments}) as the last pass of "
                        "the plan given to dtmega.parallelize (dtmega.passes.Compile)")
