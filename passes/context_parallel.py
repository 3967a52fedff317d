"""Context parallelism as a pass: the sequence is sharded over the `cp` axis and the model's
attention core is replaced by context-parallel attention (ring, all-gather or all-to-all).

Unlike torch's `context_parallel` (which patches SDPA globally and needs a GPU SDPA backend),
this rewrites the attention modules the layout names, and runs on gloo and nccl alike.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtmega.kernels.context_attention import METHODS, context_parallel_attention
from dtmega.kernels.context_shards import CommStats, token_indices
from dtmega.kernels.document_shards import document_starts, shard_batch_documents
from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.program import Program
from dtmega.passes.results import ContextSharding, DataParallelism
from dtmega.passes.runtime import Batch, RuntimeHook
from dtmega.passes.slots import refuse_dropping_cores

LOAD_BALANCE = ("zigzag", None)
_HF_NAMES = itertools.count()


class ContextParallelAttention(nn.Module):
    """Drop-in attention core for [B, S, H, D] q/k/v sharded on S over `group`."""

    def __init__(self, group, method: str, zigzag: bool, stats: CommStats, document_backend: str | None = None):
        super().__init__()
        self.group, self.method, self.zigzag, self.stats = group, method, zigzag, stats
        self.document_backend = document_backend  # how packed documents are masked (DocumentMasking)

    def forward(self, q, k, v, *args, scale=None, is_causal=True, attention_masks=None, q_offset=0, documents=None,
                **kwargs):
        if documents is None and isinstance(attention_masks, torch.Tensor) and attention_masks.dtype in (
                torch.int32, torch.int64):
            documents, attention_masks = attention_masks, None  # a family passing document ids as its masks
        if attention_masks is not None:
            raise ValueError("context-parallel attention handles causal and full masks only, not attention_masks")
        if isinstance(q_offset, torch.Tensor) or q_offset:
            raise ValueError("context-parallel attention does not decode with a KV cache; generate without CP")
        if documents is not None and self.document_backend is None:
            raise ValueError("packed documents reached context-parallel attention without a DocumentMasking pass")
        return context_parallel_attention(q, k, v, group=self.group, method=self.method, zigzag=self.zigzag,
                                          causal=is_causal, scale=scale, stats=self.stats, documents=documents,
                                          document_backend=self.document_backend)

    def extra_repr(self) -> str:
        return f"method={self.method}, zigzag={self.zigzag}"


def hf_attention_function(group, method: str, zigzag: bool, stats: CommStats):
    """A Hugging Face attention implementation ([B, H, S, D] in, [B, S, H, D] out)."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if dropout:
            raise ValueError("context-parallel attention does not support attention dropout")
        out = context_parallel_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), group=group, method=method,
            zigzag=zigzag, causal=getattr(module, "is_causal", True), scale=scaling, stats=stats,
        )
        return out, None

    return attention


@dataclass
class ContextParallel(Pass):
    """Shards the sequence over `axis` (zigzag: rank r holds chunks r and 2*cp-1-r of 2*cp, so
    causal work is balanced) and runs attention with `method` = ring | all_gather | a2a.
    Position ids stay global. Needs a DataParallel pass (gradients are averaged over dp x cp).

    With DocumentMasking under ring or all-gather, load_balance="zigzag" balances by documents
    instead: each sample's chunks are dealt so every rank's queries attend the same number of
    query-key pairs within their documents (kernels/document_shards.py), per batch; None keeps
    contiguous shards."""

    axis: str = "cp"
    method: str = "ring"
    load_balance: str | None = "zigzag"

    provides = ("context_parallel@{axis}",)
    refines = ("document_masking",)  # its attention kernel masks the documents DocumentMasking chose (options)
    role = "context"

    def annotate(self, program: Program) -> None:
        size = program.axis_size(self.axis)
        if self.method not in METHODS:
            raise PlanError(f"ContextParallel(method={self.method!r}) is unknown; use one of {METHODS}")
        if self.load_balance not in LOAD_BALANCE:
            raise PlanError(f"ContextParallel(load_balance={self.load_balance!r}); use 'zigzag' or None")
        family = program.family
        if family is None or (family.attention_core is None and not family.name.startswith("hf-")):
            raise PlanError(
                f"ContextParallel cannot find the attention of {type(program.model).__name__}: its model family "
                "names no attention-core module. Fix: register a family with attention_core, or drop ContextParallel"
            )
        facts = program.facts
        if size > 1 and facts.moe is not None and facts.moe.capacity_factor is not None:
            raise PlanError(
                f"the model's MoE layers drop tokens above capacity per sequence (capacity_factor="
                f"{facts.moe.capacity_factor}), which needs whole sequences on a rank, but ContextParallel splits "
                "them. Fix: dropless routing (capacity_factor=None) with context parallelism"
            )
        tp = program.role_size("tensor")
        if self.method == "a2a" and (facts.n_heads // tp) % size:
            raise PlanError(
                f"ContextParallel(method='a2a') moves heads between ranks: {facts.n_heads // tp} heads per rank "
                f"are not divisible by cp={size}. Fix: method='ring' or 'all_gather', or another cp size"
            )
        targets = []
        if family.attention_core is not None:
            for block in program.blocks():
                fqn = f"{block}.{family.attention_core}"
                inner = program.modules.get(fqn)
                if inner is None:
                    raise PlanError(f"ContextParallel expected an attention core at {fqn!r}; none found")
                kind = type(inner).__name__
                if kind in ("FlexAttention", "VarlenAttention"):
                    raise PlanError(
                        f"{fqn} is {kind}, whose block/document masks context parallelism cannot handle (it "
                        "handles causal and full masks). Fix: build the model with ScaledDotProductAttention"
                    )
                program.layout[fqn].kernel = f"attention.context_parallel.{self.method}"
                targets.append(fqn)
            refuse_dropping_cores(program, targets, f"ContextParallel(method={self.method!r})",
                                  "--attention-dropout 0 with context parallelism (hidden dropout is kept), or no CP")
        else:
            implementation = getattr(program.model.config, "_attn_implementation", "sdpa")
            if implementation not in ("sdpa", "eager"):
                raise PlanError(f"ContextParallel replaces 'sdpa'/'eager' attention, not {implementation!r}")
            for block in facts.blocks:
                program.layout[block].kernel = f"attention.context_parallel.{self.method}"
        program.layout[""].inputs[self.axis] = "S(1)"  # tokens (and every activation) sharded on the sequence
        program.record(ContextSharding(self.axis, size, self.method, self.load_balance == "zigzag", tuple(targets)))
        program.note(f"ContextParallel({self.method}, cp={size}, load_balance={self.load_balance})")

    def finalize(self, program: Program) -> None:
        if program.axis_size(self.axis) > 1 and program.result(DataParallelism) is None:
            raise PlanError(
                "ContextParallel splits every sequence over cp ranks, whose gradients must then be averaged: add "
                "DataParallel('ddp') (or 'fsdp') to the plan, after ContextParallel"
            )
        workload, sharding = program.workload, program.require(ContextSharding, "ContextParallel")
        if workload is not None and workload.seq_len % sharding.parts:
            how = f"2 x cp = {sharding.parts} (zigzag load balancing)" if sharding.zigzag else f"cp = {sharding.parts}"
            raise PlanError(
                f"sequence length {workload.seq_len} is not divisible by {how}. Fix: a sequence length that is a "
                f"multiple of {sharding.parts}" + (", or ContextParallel(load_balance=None)" if sharding.zigzag else "")
            )

    def apply(self, program: Program) -> None:
        sharding = program.require(ContextSharding, "ContextParallel.apply")
        mesh = program.submesh(self.axis)
        group, stats = mesh.get_group(), CommStats()
        from dtmega.passes.document_masking import DocumentMaskingChoice

        documents = program.result(DocumentMaskingChoice)
        by_documents = documents is not None and documents.backend != "positions" and self.method != "a2a"
        program.add_hook(SequenceSharding(sharding, mesh, stats, by_documents))
        for fqn in sharding.targets:
            parent_fqn, _, name = fqn.rpartition(".")
            for parent in program.modules_at(parent_fqn):
                setattr(parent, name, ContextParallelAttention(group, self.method, sharding.zigzag, stats,
                                                               documents.backend if documents else None))
        if not sharding.targets:  # Hugging Face: a registered attention implementation
            from transformers import AttentionInterface

            key = f"dtmega_context_parallel_{next(_HF_NAMES)}"
            AttentionInterface.register(key, hf_attention_function(group, self.method, sharding.zigzag, stats))
            for part in program.parts:
                part.config._attn_implementation = key


class SequenceSharding(RuntimeHook):
    """Keeps this context-parallel rank's tokens of every sequence (zigzag chunks, positions
    global) before anything runs; `comm` counts what the attention ops sent. `by_documents`
    (packed documents under ring or all-gather): each sample's tokens are dealt by document
    work (kernels/document_shards.py) and its document ids become the documents' start
    positions, from which the attention recovers the deal."""

    def __init__(self, sharding: ContextSharding, mesh, comm: CommStats, by_documents: bool = False):
        self.sharding, self.rank, self.comm = sharding, mesh.get_local_rank(), comm
        self.group, self.by_documents = mesh.get_group(), by_documents
        self._order: torch.Tensor | None = None  # [B, S]: the last batch's tokens, rank after rank

    def unshard_output(self, output: torch.Tensor) -> torch.Tensor:
        """Every cp rank's [B, S/cp, ...] output, back in sequence order on every rank (a
        vocab-sharded DTensor stays one: its local shards are gathered)."""
        if self.sharding.size == 1:
            return output
        local = output.to_local() if isinstance(output, DTensor) else output
        pieces = [torch.empty_like(local) for _ in range(self.sharding.size)]
        dist.all_gather(pieces, local.contiguous(), group=self.group)
        seq = local.shape[1] * self.sharding.size
        whole = torch.empty((local.shape[0], seq, *local.shape[2:]), dtype=local.dtype, device=local.device)
        if self.by_documents:
            rows = torch.arange(local.shape[0], device=local.device)[:, None]
            whole[rows, self._order.to(local.device)] = torch.cat(pieces, dim=1)
        else:
            order = torch.cat([token_indices(seq, self.sharding.size, rank, self.sharding.zigzag, device=local.device)
                               for rank in range(self.sharding.size)])
            whole[:, order] = torch.cat(pieces, dim=1)
        if isinstance(output, DTensor):
            return DTensor.from_local(whole, output.device_mesh, output.placements, run_check=False)
        return whole

    def shard_batch(self, batch: Batch) -> Batch:
        if self.sharding.size == 1:
            return batch
        seq, parts = batch.tokens.shape[1], self.sharding.parts
        if seq % parts:
            how = f"2 x cp = {parts} (zigzag load balancing)" if self.sharding.zigzag else f"cp = {parts}"
            raise PlanError(
                f"sequence length {seq} is not divisible by {how}. Fix: use a sequence length that is a multiple "
                f"of {parts}" + (", or ContextParallel(load_balance=None)" if self.sharding.zigzag else "")
            )
        positions = batch.position_ids
        if positions is None:
            positions = torch.arange(seq, device=batch.tokens.device).expand(batch.tokens.shape)
        batch = dataclasses.replace(batch, position_ids=positions)
        if self.by_documents:
            return self._shard_by_documents(batch)
        index = token_indices(seq, self.sharding.size, self.rank, self.sharding.zigzag, device=batch.tokens.device)
        return batch.map(lambda tensor: shard_sequence(tensor, index))

    def _shard_by_documents(self, batch: Batch) -> Batch:
        ids = batch.extra["document_ids"]
        shards = shard_batch_documents(ids, self.sharding.size, balanced=self.sharding.zigzag)
        self._order = torch.stack([shard.positions.flatten() for shard in shards])
        index = torch.stack([shard.positions[self.rank] for shard in shards]).to(batch.tokens.device)
        batch = dataclasses.replace(batch, extra={**batch.extra, "document_ids": document_starts(ids)})
        rows = torch.arange(index.shape[0], device=index.device)[:, None]
        return batch.map(lambda tensor: tensor[rows.to(tensor.device), index.to(tensor.device)])


def shard_sequence(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """This cp rank's columns of a [B, S, ...] tensor."""
    return tensor.index_select(1, index.to(tensor.device))
