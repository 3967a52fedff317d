"""Pipeline parallelism as a pass: split the blocks into stages, keep only this rank's stages.

`annotate` assigns every module to a stage (even, uneven first/last, embedding and loss counted
as layers, or an explicit layout string) and checks the schedule's constraints; `apply` prunes a
meta-device copy of the model down to each local stage (same FQNs, other stages' parameters
never materialized). `passes/pipeline_runtime.py` drives the stages with torch's schedules.
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.pipeline_runtime import PipelineExecutor, check_microbatches
from dtmega.passes.program import Program
from dtmega.passes.results import PipelineStages
from dtmega.passes.tied_embeddings import TiedEmbeddingSync, embedding_peer, tied_embedding_name

# name -> (torch schedule class name, how stages map to ranks)
SCHEDULES = {
    "gpipe": ("GPipe", "single"),
    "1f1b": ("1F1B", "single"),
    "interleaved_1f1b": ("Interleaved1F1B", "looped"),
    "looped_bfs": ("LoopedBFS", "looped"),
    "interleaved_zero_bubble": ("InterleavedZeroBubble", "looped"),
    "zbv": ("ZBVZeroBubble", "v"),
    "dualpipev": ("DualPipeV", "v"),
}
_LAYOUT_TOKEN = re.compile(r"([EtL])(?:\*(\d+))?")


def rank_of_stage(stage: int, pp: int, placement: str) -> int:
    """Which pipeline rank holds `stage`: round robin (looped), or a V (rank r holds r and 2p-1-r)."""
    if placement == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def parse_layout(text: str, stages: int, n_layers: int) -> list[tuple[int, bool, bool]]:
    """'Et*3|t*4|t*3L' -> per stage (blocks, has embedding, has loss)."""
    parts = text.replace(" ", "").split("|")
    if len(parts) != stages:
        raise PlanError(f"pipeline layout {text!r} has {len(parts)} stages; the plan needs {stages} (pp x virtual_stages)")
    result = []
    for index, part in enumerate(parts):
        consumed = "".join(m.group(0) for m in _LAYOUT_TOKEN.finditer(part))
        if consumed != part:
            raise PlanError(f"pipeline layout stage {index} {part!r}: use E (embedding), t (block), L (loss), t*N")
        blocks = embedding = loss = 0
        for kind, count in _LAYOUT_TOKEN.findall(part):
            n = int(count) if count else 1
            blocks += n if kind == "t" else 0
            embedding += n if kind == "E" else 0
            loss += n if kind == "L" else 0
        if not (blocks or embedding or loss):
            raise PlanError(f"pipeline layout {text!r}: stage {index} holds no layers")
        result.append((blocks, embedding > 0, loss > 0))
    if ([i for i, (_, e, _) in enumerate(result) if e] != [0]
        or [i for i, (_, _, has_loss) in enumerate(result) if has_loss] != [stages - 1]):
        raise PlanError(f"pipeline layout {text!r}: E must appear once, in the first stage, and L once, in the last")
    if sum(b for b, _, _ in result) != n_layers:
        raise PlanError(f"pipeline layout {text!r} places {sum(b for b, _, _ in result)} blocks; the model has {n_layers}")
    return result


@dataclass
class PipelineSplit(Pass):
    """Splits the model's blocks into `pp x virtual_stages` stages run by a torch schedule.

    schedule: gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv, dualpipev.
    microbatches: per step (default: the number of stages); a batch must split into them evenly.
    first_stage_layers / last_stage_layers: uneven first/last stages (Megatron's
    --decoder-first/last-pipeline-num-layers); count_embedding / count_loss: the embedding and the
    loss take one layer's slot (Megatron's --account-for-embedding/loss-in-pipeline-split);
    layout: an explicit split such as "Et*3|t*4|t*4|t*3L".
    """

    axis: str = "pp"
    schedule: str = "1f1b"
    microbatches: int | None = None
    virtual_stages: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    count_embedding: bool = False
    count_loss: bool = False
    layout: str | None = None

    provides = ("pipeline@{axis}",)
    role = "pipeline"
    structural = True

    # ---- checks -------------------------------------------------------------------------------
    def _check_schedule(self, pp: int) -> tuple[str, str]:
        if self.schedule not in SCHEDULES:
            raise PlanError(f"PipelineSplit(schedule={self.schedule!r}) is unknown; use one of {list(SCHEDULES)}")
        torch_name, placement = SCHEDULES[self.schedule]
        v = self.virtual_stages
        if not isinstance(v, int) or v < 1:
            raise PlanError(f"virtual_stages={v!r} must be a positive integer")
        if placement == "single" and v != 1:
            raise PlanError(f"schedule {self.schedule!r} runs one stage per rank; use virtual_stages=1 or an "
                            "interleaved schedule (interleaved_1f1b, looped_bfs, interleaved_zero_bubble)")
        if placement == "v" and v != 2:
            raise PlanError(f"schedule {self.schedule!r} needs exactly two stages per rank (a V): use virtual_stages=2")
        return torch_name, placement

    def check_microbatches(self, microbatches: int, pp: int) -> None:
        """The schedule's demands on the number of micro-batches (also checked per step)."""
        check_microbatches(self.schedule, self.virtual_stages, microbatches, pp)

    def _stage_sizes(self, stages: int, n_layers: int) -> list[tuple[int, bool, bool]]:
        if self.layout:
            return parse_layout(self.layout, stages, n_layers)
        flags = [(i == 0, i == stages - 1) for i in range(stages)]
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            if stages < 2:
                raise PlanError("first_stage_layers/last_stage_layers need at least two stages")
            first = self.first_stage_layers if self.first_stage_layers is not None else None
            last = self.last_stage_layers if self.last_stage_layers is not None else None
            middle_stages = stages - 2 + (first is None) + (last is None)
            rest = n_layers - (first or 0) - (last or 0)
            if middle_stages == 0:
                if rest:
                    raise PlanError(f"first/last stage layers ({first}+{last}) must add up to {n_layers} with 2 stages")
                per = 0
            elif rest < 0 or rest % middle_stages:
                raise PlanError(
                    f"after first_stage_layers={first} and last_stage_layers={last}, {rest} blocks remain for "
                    f"{middle_stages} stages: not an even split. Fix: choose first/last so the rest divides evenly"
                )
            else:
                per = rest // middle_stages
            sizes = [per] * stages
            if first is not None:
                sizes[0] = first
            if last is not None:
                sizes[-1] = last
            return [(b, e, has_loss) for b, (e, has_loss) in zip(sizes, flags)]
        units = n_layers + int(self.count_embedding) + int(self.count_loss)
        if units % stages:
            counted = " (+ embedding)" * self.count_embedding + " (+ loss)" * self.count_loss
            raise PlanError(
                f"{n_layers} blocks{counted} do not split evenly into {stages} stages (pp x virtual_stages). "
                "Fix: change pp or virtual_stages, or split unevenly with first_stage_layers/last_stage_layers "
                "or an explicit layout='Et*..|..|t*..L'"
            )
        per = units // stages
        sizes = [per - int(self.count_embedding and e) - int(self.count_loss and has_loss) for e, has_loss in flags]
        return [(b, e, has_loss) for b, (e, has_loss) in zip(sizes, flags)]

    # ---- the two halves ------------------------------------------------------------------------
    def annotate(self, program: Program) -> None:
        pp = program.axis_size(self.axis)
        torch_name, placement = self._check_schedule(pp)
        stages = pp * self.virtual_stages
        if self.microbatches is not None:
            self.check_microbatches(self.microbatches, pp)
        facts = program.facts
        if facts.tied_embeddings and stages > 1:
            program.note("PipelineSplit: the tied word embedding lives on the first stage and a copy on the last, "
                         "their gradients summed over an embedding group after each backward (Megatron's scheme)")
        container = facts.blocks[0].rpartition(".")[0]
        if not isinstance(program.modules.get(container), nn.ModuleDict):
            raise PlanError(
                f"pipeline splitting keeps block names by deleting blocks from their container, which must be an "
                f"nn.ModuleDict; {type(program.model).__name__}.{container} is a "
                f"{type(program.modules.get(container)).__name__}. Models such as dtmega's and torchtitan's Llama qualify"
            )
        sizes = self._stage_sizes(stages, facts.n_layers)
        empty = [i for i, (blocks, e, has_loss) in enumerate(sizes) if blocks == 0 and not (e and self.count_embedding)
                 and not (has_loss and self.count_loss) and not self.layout]
        if empty or any(b < 0 for b, _, _ in sizes):
            raise PlanError(
                f"stage(s) {empty or [i for i, (b, _, _) in enumerate(sizes) if b < 0]} would hold no layers "
                f"(blocks per stage: {[b for b, _, _ in sizes]}). Fix: fewer stages or a different uneven split"
            )
        assignment: list[list[str]] = []
        start = 0
        for blocks, _, _ in sizes:
            assignment.append(list(facts.blocks[start:start + blocks]))
            start += blocks
        ranks = [rank_of_stage(s, pp, placement) for s in range(stages)]
        virtual = [sum(1 for t in range(s) if ranks[t] == ranks[s]) for s in range(stages)]
        for stage, fqns in enumerate(assignment):
            for block in fqns:
                self._mark(program, block, stage, virtual[stage])
        self._mark(program, facts.embedding, 0, virtual[0])
        for head in (facts.final_norm, facts.output, *facts.head_modules):
            self._mark(program, head, stages - 1, virtual[-1])
        program.layout.stage_ranks, program.layout.stage_axis = ranks, self.axis
        program.record(PipelineStages(
            self.axis, self.schedule, torch_name, placement, stages, self.virtual_stages, tuple(ranks),
            tuple(tuple(a) for a in assignment), self.microbatches or stages,
        ))
        program.note(f"PipelineSplit({self.schedule}): {stages} stages, blocks per stage {[len(a) for a in assignment]}")

    @staticmethod
    def _mark(program: Program, fqn: str, stage: int, virtual_stage: int) -> None:
        for name, entry in program.layout.modules.items():
            if name == fqn or name.startswith(fqn + "."):
                entry.stage, entry.virtual_stage = stage, virtual_stage

    def finalize(self, program: Program) -> None:
        workload, stages = program.workload, program.require(PipelineStages, "PipelineSplit")
        if workload is not None and workload.microbatches is not None:
            check_microbatches(stages.schedule, stages.virtual_stages, workload.microbatches,
                               program.axis_size(self.axis))

    def apply(self, program: Program) -> None:
        info = program.require(PipelineStages, "PipelineSplit.apply")
        pp_mesh = program.submesh(self.axis)
        local = info.local_stages(pp_mesh.get_local_rank())
        facts = program.facts
        boundary = _boundary_placement(program)
        tp_mesh = program.submesh(program.axes.name("tensor")) if boundary is not None else None
        parts = []
        for stage in local:
            part = copy.deepcopy(program.model)
            keep = set(info.blocks[stage])
            for block in facts.blocks:
                if block not in keep:
                    container, _, name = block.rpartition(".")
                    del part.get_submodule(container)[name]
            if stage != 0:
                _drop(part, facts.embedding)
            if stage != info.stages - 1:
                for head in (facts.final_norm, facts.output, *facts.head_modules):
                    _drop(part, head)
            _install_boundary_hooks(part, first=stage == 0, boundary=boundary, tp_mesh=tp_mesh)
            parts.append(part)
        program.parts = parts
        program.executor = PipelineExecutor(program, local, _tied_sync(program, info, parts, local))
        program.note(f"PipelineSplit: pp rank {pp_mesh.get_local_rank()} holds stages {local}")


def _tied_sync(program: Program, info, parts: list[nn.Module], local: list[int]) -> TiedEmbeddingSync | None:
    """The gradient sum that keeps a tied embedding's two copies equal (passes/tied_embeddings.py)."""
    facts = program.facts
    name = tied_embedding_name(program.model, facts.output) if facts.tied_embeddings and info.stages > 1 else None
    if name is None:
        return None
    first, last = info.rank_of_stage[0], info.rank_of_stage[-1]
    peer = embedding_peer(program.mesh, info.axis, first, last)
    by_stage = dict(zip(local, parts))
    embedding = by_stage[0].get_submodule(name.rpartition(".")[0]) if 0 in by_stage else None
    output = by_stage[info.stages - 1].get_submodule(facts.output) if info.stages - 1 in by_stage else None
    if embedding is None and output is None:
        return None
    return TiedEmbeddingSync(embedding, output, name, peer, program.submesh(info.axis).get_group())


def _drop(part: nn.Module, fqn: str) -> None:
    parent, _, name = fqn.rpartition(".")
    setattr(part.get_submodule(parent) if parent else part, name, None)


def _boundary_placement(program: Program):
    """How the residual stream is laid out where stages meet: sequence-sharded under SP, else
    replicated plain tensors (no conversion needed)."""
    if any(e.style == "sequence_norm" for e in program.layout.modules.values()):
        return Shard(1)
    return None


def _install_boundary_hooks(part: nn.Module, *, first: bool, boundary, tp_mesh) -> None:
    """Stages exchange plain tensors: outputs leave as their local shard, and a later stage's
    input becomes the DTensor the blocks expect again."""

    def to_local(module, inputs, output):
        return output.to_local() if isinstance(output, DTensor) else output

    part.register_forward_hook(to_local)
    # DTensor.to_local() returns a view, and FSDP2 warns about any view a wrapped root returns
    # (an in-place op on it would skip FSDP's pre-backward hook). A stage's output is never
    # mutated: it is sent to the next stage or consumed by the loss. Copying it would cost a
    # tensor the size of the logits on the last stage, so this one warning is silenced for
    # the stage's own class instead.
    warnings.filterwarnings(
        "ignore", message=rf"FSDP2-wrapped module \((FSDP|Replicate)?{type(part).__name__}\) returned a view tensor",
        category=UserWarning,
    )
    if first or boundary is None:
        return

    def from_local(module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor) and not isinstance(args[0], DTensor):
            args = (DTensor.from_local(args[0], tp_mesh, [boundary], run_check=False), *args[1:])
        return args, kwargs

    part.register_forward_pre_hook(from_local, with_kwargs=True)
