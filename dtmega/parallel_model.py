"""ParallelModel: what `parallelize` returns. One `forward_backward` for every plan."""

from __future__ import annotations

import torch
import torch.distributed as dist
from rich.table import Table
from tensordict import TensorDict
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from dtmega.batch import Batch, unpack_batch
from dtmega.kernels import cross_entropy_context, per_token_cross_entropy, token_indices
from dtmega.moe_runtime import MoERuntime
from dtmega.passes import Layout, Plan, PlanError, Program
from dtmega.passes.context_parallel import shard_sequence
from dtmega.passes.families import default_logits
from dtmega.passes.render import layout_table
from dtmega.passes.tp_styles import STYLES
from dtmega.pipeline_runtime import PipelineParts, PipelineRuntime
from dtmega.pipeline_table import schedule_table

TP_STYLES = {name for name, style in STYLES.items() if style.owner == "tensor_parallel"}


class ParallelModel:
    """A model sharded by a plan: the transformed `module`, its `layout`, and a training step.

    `forward_backward(batch)` takes this data-parallel rank's batch, accumulates gradients
    into the parameters, and returns the loss of the *global* batch (the same value on every
    rank): the token-weighted mean cross entropy over all data-parallel ranks, exactly as the
    unsharded model computes it on the concatenated batch.
    """

    def __init__(self, program: Program, plan: Plan):
        self.program = program
        self.plan = plan
        parts = program.parts
        self._module = parts[0] if len(parts) == 1 else PipelineParts(parts)
        self._pipeline: PipelineRuntime | None = None
        self.moe = MoERuntime(program)
        self.last_moe_loss = 0.0  # the balancing-loss part of the last forward_backward's loss

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
    def pipelined(self) -> bool:
        """True if the plan split the model into pipeline stages."""
        return "pipeline" in self.program.state

    def pipeline(self) -> PipelineRuntime:
        """The stages and schedules of a pipeline-split model (built on first use)."""
        if not self.pipelined:
            raise RuntimeError("this plan has no PipelineSplit")
        if self._pipeline is None:
            sharded = any(e.style == "output" for e in self.layout.modules.values())
            kwarg = self.program.family.position_kwarg if self.program.family else "position_ids"
            self._pipeline = PipelineRuntime(
                self.program, sharded, lambda positions: {} if positions is None else {kwarg: positions}
            )
        return self._pipeline

    def pipeline_group(self):
        """The pipeline-parallel process group (None without pipelining)."""
        return self.pipeline().group if self.pipelined else None

    def schedule_table(self, microbatches: int | None = None) -> Table:
        """The schedule's actions per rank per tick (F forward, B backward, I input-grad,
        W weight-grad; the number is the micro-batch, s the stage) as a rich table."""
        microbatches = microbatches or self.program.state["pipeline"]["microbatches"]
        return schedule_table(self.pipeline().schedule(microbatches), self.program.state["pipeline"])

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

    def report(self, *, fold: bool = True) -> Table:
        """A rich table of the layout with bytes per rank (`rich.print(pm.report())`)."""
        mesh = " x ".join(f"{axis}={size}" for axis, size in self.layout.mesh.items() if size > 1) or "1 rank"
        return layout_table(self.layout, fold=fold, title=f"{self.layout[''].type} on {mesh}")

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
        """Number of data-parallel ranks (dp_replicate x dp_shard x ep): the batch splits over them."""
        return self.program.data_size(context=False)

    def _dp_mesh(self):
        return self.program.flat_submesh(self.program.data_axes(context=False))

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks."""
        return self._dp_mesh().get_local_rank() if self.dp_size > 1 else 0

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
    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `tokens` (vocab-sharded DTensor under tensor parallelism)."""
        if self.pipelined:
            raise RuntimeError("a pipeline-parallel model has no single-rank forward; use forward_backward or loss_sum")
        logits_fn = self.program.family.logits if self.program.family else default_logits
        return logits_fn(self.module, tokens, position_ids)

    __call__ = forward

    @property
    def cp_size(self) -> int:
        """Number of context-parallel ranks a sequence is split over."""
        return self.program.state["context_parallel"]["size"] if "context_parallel" in self.program.state else 1

    @property
    def _averaged_over(self) -> int:
        # DataParallel averages gradients over dp (x cp) ranks; every rank scales its loss by it.
        return self.program.data_size()

    def _data_all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        """Sums over every rank that holds different tokens of the global batch (dp x cp)."""
        if self.program.data_size() > 1:
            dist.all_reduce(value, group=self.program.flat_submesh(self.program.data_axes()).get_group())
        return value

    def _shard_sequence(self, fields: Batch) -> Batch:
        """This context-parallel rank's tokens of every sequence (positions stay global)."""
        if self.cp_size == 1:
            return fields
        info = self.program.state["context_parallel"]
        seq = fields.tokens.shape[1]
        parts = 2 * self.cp_size if info["zigzag"] else self.cp_size
        if seq % parts:
            how = f"2 x cp = {parts} (zigzag load balancing)" if info["zigzag"] else f"cp = {parts}"
            raise ValueError(
                f"sequence length {seq} is not divisible by {how}. Fix: use a sequence length that is a multiple "
                f"of {parts}" + (", or ContextParallel(load_balance=None)" if info["zigzag"] else "")
            )
        rank = self.program.submesh(info["axis"]).get_local_rank()
        index = token_indices(seq, self.cp_size, rank, info["zigzag"], device=fields.tokens.device)
        positions = fields.position_ids
        if positions is None:
            positions = torch.arange(seq, device=fields.tokens.device).expand(fields.tokens.shape)
        return Batch(*(shard_sequence(t, index) for t in (fields.tokens, fields.labels, fields.loss_mask, positions)))

    def _reshard(self) -> None:
        # FSDP2 leaves the root gathered after a no-grad forward (the root never reshards after
        # forward), so `parameters()` would list the gathered tensors, not the sharded ones the
        # optimizer holds, until the next backward.
        for part in self.parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _set_gradient_sync(self, enabled: bool) -> None:
        if isinstance(self.module, FSDPModule):
            self.module.set_requires_gradient_sync(enabled)

    def forward_backward(
        self, batch: TensorDict, microbatches: int | None = None, loss_scale: float = 1.0
    ) -> torch.Tensor:
        """Forward and backward over this rank's `batch`, split into `microbatches` (gradient
        accumulation; the pipeline's micro-batches under pipeline parallelism, by default the
        plan's); returns the detached global mean loss. Gradients are those of `loss_scale` x
        the loss (fp16 loss scaling)."""
        vocab = self.program.facts.vocab_size if self.program.family else None
        whole = self._shard_sequence(unpack_batch(batch, vocab))
        tokens_with_loss = self._data_all_reduce(whole.loss_mask.sum().to(torch.float32))
        if float(tokens_with_loss) == 0:
            raise ValueError("the global batch has no token with loss_mask=1; nothing to learn from")
        scale = self._averaged_over * loss_scale / tokens_with_loss
        if self.pipelined:
            microbatches = microbatches or self.program.state["pipeline"]["microbatches"]
        steps = microbatches or 1
        # The balancing losses are per micro-batch: the objective averages them over this call's.
        self.moe.set_loss_scale(self._averaged_over * loss_scale / steps)
        before = self.moe.local_loss()
        if self.pipelined:
            loss_sum = self.pipeline().run(whole, microbatches, float(scale))
            return self._data_all_reduce(loss_sum) / tokens_with_loss + self._moe_loss(before, steps)
        fields = whole.split(steps)
        device = fields[0].tokens.device
        loss_sum = torch.zeros((), device=device)
        for index, chunk in enumerate(fields):
            self._set_gradient_sync(index == len(fields) - 1)
            logits = self.forward(chunk.tokens, chunk.position_ids)
            with cross_entropy_context(logits):
                losses = per_token_cross_entropy(logits, chunk.labels)
                chunk_sum = (losses * chunk.loss_mask).sum()
                (chunk_sum * scale).backward()
            loss_sum += chunk_sum.detach()
        return self._data_all_reduce(loss_sum) / tokens_with_loss + self._moe_loss(before, steps)

    def _moe_loss(self, before: torch.Tensor, steps: int) -> torch.Tensor | float:
        """The mixture-of-experts balancing losses of the call just run (0 without MoE layers)."""
        if not self.moe:
            return 0.0
        loss = self.moe.global_loss(self.moe.local_loss() - before) / steps
        self.last_moe_loss = float(loss)
        return loss.to(self.mesh.device_type)

    def update_expert_bias(self) -> None:
        """After the optimizer step: moves every MoE router's expert bias towards balance
        (auxiliary-loss-free load balancing); a no-op for models without one."""
        self.moe.update_expert_bias()

    def moe_stats(self) -> dict:
        """Per-layer expert load and the dropped fraction since the last call (collective)."""
        return self.moe.pop_stats()

    @torch.no_grad()
    def loss_sum(self, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, number of loss tokens) of the *global* batch this rank's `batch` is part
        of, without gradients: for validation, where batches are averaged by tokens."""
        vocab = self.program.facts.vocab_size if self.program.family else None
        fields = self._shard_sequence(unpack_batch(batch, vocab))
        if self.pipelined:
            loss = self.pipeline().run(fields, self.program.state["pipeline"]["microbatches"], 1.0, train=False)
            totals = self._data_all_reduce(torch.stack([loss, fields.loss_mask.sum()]).float())
            return totals[0], totals[1]
        logits = self.forward(fields.tokens, fields.position_ids)
        with cross_entropy_context(logits):
            losses = per_token_cross_entropy(logits, fields.labels)
        self._reshard()
        totals = torch.stack([(losses * fields.loss_mask).sum(), fields.loss_mask.sum()]).float()
        totals = self._data_all_reduce(totals)
        return totals[0], totals[1]

    def compile(self, **kwargs) -> "ParallelModel":
        """`torch.compile`s every transformer block in place (parameter names unchanged);
        keyword arguments go to torch.compile (e.g. backend="inductor" or "aot_eager").

        Blocks, not the whole model: on torch 2.13, Dynamo/AOT autograd fail on the whole
        tensor-parallel model for some shapes ("Mixing fake modes" at the vocab-parallel
        embedding, invalid tangents in backward), while per-block graphs are stable. For the
        same reason tensor parallelism needs SequenceParallel here: compiled TP blocks with
        replicated activations crash in backward for some shapes. Shapes are static unless
        `dynamic` is given (training shapes are fixed), except in MoE models, where Dynamo's
        automatic dynamic shapes cover the changing number of tokens per expert.
        """
        has_tp = any(e.style in TP_STYLES for e in self.layout.modules.values())
        has_sp = any(e.style == "sequence_norm" for e in self.layout.modules.values())
        if has_tp and not has_sp:
            raise PlanError(
                "compile() of a tensor-parallel model needs SequenceParallel in the plan: on torch "
                "2.13 compiled TP blocks with replicated activations crash in backward for some "
                "shapes. Fix: add SequenceParallel() after TensorParallel(), or run without compile"
            )
        # Training shapes are fixed, except the tokens each expert gets: MoE blocks let Dynamo
        # mark the sizes that change dynamic after the first recompile.
        kwargs.setdefault("dynamic", None if self.moe else False)
        for fqn in self.program.blocks():
            self.program.module(fqn).compile(**kwargs)
            self.layout[fqn].kernel = f"compiled ({kwargs.get('backend', 'inductor')})"
        return self

    # ---- weights ------------------------------------------------------------------------------
    def init_weights(self, seed: int = 0, device: torch.device | str | None = None) -> None:
        """Materializes meta parameters on `device` and initializes them; the values equal the
        unsharded model's `init_weights(seed)` whatever the plan."""
        if device is None:
            device = self.mesh.device_type if self.mesh is not None else "cpu"
        for part in self.parts:
            if any(p.is_meta for p in part.parameters()) or any(b.is_meta for b in part.buffers()):
                part.to_empty(device=device)
            init = getattr(part, "init_weights", None)
            if init is None:
                raise NotImplementedError(
                    f"{type(part).__name__} has no init_weights(seed, buffer_device); load weights "
                    "with load_full_state_dict instead"
                )
            init(seed=seed, buffer_device=torch.device(device))

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads unsharded weights (every rank passes the same dict); each rank keeps its shard."""
        set_model_state_dict(
            self.module, state_dict, options=StateDictOptions(full_state_dict=True, strict=True)
        )

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights, gathered on every rank (small models, tests, export)."""
        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
