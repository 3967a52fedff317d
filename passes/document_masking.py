"""Packed documents as a pass: attention causal within each document, positions restarting per
document, under the other passes of the plan.

A batch then carries `document_ids` ([B, S] integers, equal = one document; built by
`dtmega.document_ids_from_lengths`, or from end-of-document tokens by `dtmega train
--reset-attention-mask`). The model builds one mask per forward from them and hands it to every
attention core (kernels/document_attention.py); this pass chooses how that mask is computed and
records it in the layout (`attention.document.flex` or `attention.document.sdpa` on each core)
and the report:

- backend="auto" (the default): "flex" on CUDA, "varlen" elsewhere;
- backend="flex": FlexAttention with a BlockMask, compiled: no [S, S] tensor, fully masked blocks
  skipped (CUDA for training: torch has no FlexAttention backward on CPU);
- backend="varlen": each document its own causal attention: nothing masked computed, no [S, S];
- backend="sdpa": SDPA with a dense boolean mask (S² bytes per sequence): the fallback.

Hugging Face's LlamaForCausalLM masks packed documents itself when its position ids restart per
document (transformers finds packed sequences in position_ids): for it the pass records that and
sets the positions from the document ids.

Composes with tensor and sequence parallelism (the mask broadcasts over the heads each rank
holds), pipeline parallelism (the ids travel with each micro-batch to every stage, as position
ids do), data parallelism, expert parallelism, full and selective recompute, compiled blocks and
FuseKernels. Under context parallelism with method="a2a" (Ulysses) each rank attends the whole
sequence for its share of the heads, so the document ids are gathered once per layer and the
same mask applies (every rank does the same attention work, whatever the documents' lengths).
Under ring and all-gather each sample's tokens are dealt to the ranks by document work
(kernels/document_shards.py) and each block of keys is attended only where it shares a
document with the queries; fully masked blocks are skipped (kernels/context_blocks.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dtmega.kernels.document_attention import BACKENDS, check_document_ids, default_backend, positions_from_documents
from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.program import Program
from dtmega.passes.results import ContextSharding, PassResult
from dtmega.passes.runtime import Batch, RuntimeHook


@dataclass(frozen=True)
class DocumentMaskingChoice(PassResult):
    """How packed documents are masked: the backend, and the attention cores it covers."""

    backend: str
    cores: tuple[str, ...]


@dataclass
class DocumentMasking(Pass):
    """Masks attention at document boundaries (see the module docstring)."""

    backend: str = "auto"  # auto | flex | varlen | sdpa

    provides = ("document_masking",)
    batch_fields = ("document_ids",)

    def chosen_backend(self, device_type: str) -> str:
        """The backend this pass runs: "auto" is FlexAttention on CUDA and the variable-length
        path elsewhere (kernels/document_attention.py says why)."""
        return default_backend(device_type) if self.backend == "auto" else self.backend

    def annotate(self, program: Program) -> None:
        if self.backend != "auto" and self.backend not in BACKENDS:
            raise PlanError(f"DocumentMasking(backend={self.backend!r}) is unknown; use 'auto', "
                            f"{', '.join(repr(b) for b in BACKENDS)}")
        family = program.family
        if family is not None and family.document_kwarg is None and family.documents_by_positions:
            for block in program.blocks():
                if block in program.layout:
                    program.layout[block].options["documents"] = "positions"
            program.record(DocumentMaskingChoice("positions", ()))
            program.note(f"DocumentMasking: {family.name} masks packed documents itself, from position ids that restart "
                         "per document (the batch's document ids set them)")
            return
        if family is None or family.document_kwarg is None or family.attention_core is None:
            name = family.name if family else type(program.model).__name__
            raise PlanError(f"document masking needs a model whose forward takes document ids; {name} does not. "
                            "Fix: dtmega's Llama or MoE models (dtmega.models), Hugging Face's LlamaForCausalLM, or "
                            "register the family with document_kwarg and attention_core")
        device_type = getattr(program.mesh, "device_type", "cpu")
        backend = self.chosen_backend(device_type)
        if backend == "flex" and device_type != "cuda":
            raise PlanError(f"DocumentMasking(backend='flex') on {device_type}: torch has no FlexAttention backward "
                            "there (it trains only on CUDA). Fix: backend='varlen' (or 'auto')")
        cores = []
        for block in program.blocks():
            core = f"{block}.{family.attention_core}"
            if core not in program.layout:
                continue  # another pipeline stage's block
            entry = program.layout[core]
            entry.options["documents"] = backend
            if entry.kernel is None:
                entry.kernel = f"attention.document.{backend}"
            cores.append(core)
        program.record(DocumentMaskingChoice(backend, tuple(cores)))
        how = {"flex": "BlockMask, masked blocks skipped, no [S, S] tensor",
               "varlen": "each document its own causal attention, no [S, S] tensor",
               "sdpa": "a dense [S, S] mask per sequence"}[backend]
        program.note(f"DocumentMasking: attention causal within each document ({backend}: {how}) on "
                     f"{len(cores)} attention cores")

    def finalize(self, program: Program) -> None:
        context = program.result(ContextSharding)
        if context is not None and context.size > 1 and not context.targets:
            raise PlanError("document masking under context parallelism needs the family's attention core, which "
                            "a Hugging Face model's registered attention function is not. Fix: dtmega's models")

    def apply(self, program: Program) -> None:
        context = program.result(ContextSharding)
        # under context parallelism the model hands its cores the (sharded) ids themselves: the
        # context-parallel attention gathers them and builds the mask for the whole sequence
        choice = program.require(DocumentMaskingChoice, "DocumentMasking.apply")
        backend = choice.backend
        if backend != "positions":
            under_context = context is not None and context.size > 1
            if under_context:
                backend = "ids"
            for part in program.parts:
                part.document_backend = backend
            family = program.family
            if family.document_core is not None and not under_context:
                self._install_cores(program, family, backend, choice.cores)
        program.add_hook(DocumentBoundaries(by_positions=backend == "positions",
                                            max_positions=program.facts.max_positions), first=True)


    @staticmethod
    def _install_cores(program: Program, family, backend: str, cores: tuple[str, ...]) -> None:
        """The family's document-masking core at every attention core; they share one mask per
        forward."""
        shared: dict = {}
        for fqn in cores:
            parent_fqn, _, name = fqn.rpartition(".")
            for parent in program.modules_at(parent_fqn):
                core = family.document_core(backend)
                core._shared = shared
                setattr(parent, name, core)


class DocumentBoundaries(RuntimeHook):
    """Before any other hook: checks each step's document ids and positions against the
    model's (the error names the fix) and,
    where the batch gives no positions, restarts them per document, so context parallelism
    shards the positions the documents imply. A model that sees documents only through its
    position ids (`by_positions`) needs them to restart at every document."""

    def __init__(self, by_positions: bool = False, max_positions: int | None = None):
        self.by_positions, self.max_positions = by_positions, max_positions

    def shard_batch(self, batch: Batch) -> Batch:
        documents = batch.extra["document_ids"]
        check_document_ids(documents, batch.tokens)
        restarting = positions_from_documents(documents)
        if batch.position_ids is None:
            batch = dataclasses.replace(batch, position_ids=restarting)
        elif self.by_positions and not torch.equal(batch.position_ids.to(restarting.dtype), restarting):
            raise PlanError("this model masks packed documents by position ids that restart at every document, but "
                            "the batch's position_ids do not. Fix: --reset-position-ids with --reset-attention-mask "
                            "(or leave position_ids out of the batch)")
        top = int(batch.position_ids.max()) if batch.position_ids.numel() else 0
        if self.max_positions is not None and top >= self.max_positions:
            raise PlanError(f"position {top}, but the model has {self.max_positions} positions (its RoPE table). Fix: "
                            "shorter samples or documents, or a model with more positions")
        return batch
