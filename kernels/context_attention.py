"""Context-parallel attention: each rank holds a shard of the sequence (queries, keys, values)
and attention still sees the whole sequence.

- ring (`ring_attention.py`): key/value blocks passed around by point-to-point transfers.
- all_gather (`allgather_attention.py`): gather every key/value shard, attend the local
  queries; the backward reduce-scatters dK/dV.
- a2a (Ulysses, here): all-to-all from sequence shards to head shards, full-sequence attention
  on H/cp heads, and back.

Masks follow from the global position of every query and key, so contiguous and zigzag shards
are both exact. Packed documents (`documents`: each token's document id) are masked by every
method: a2a gathers the ids and masks the whole sequence; ring and all-gather gather them (a few
bytes per token), recover which tokens each rank holds (kernels/document_shards.py: the ids are
the documents' start positions, as `SequenceSharding` writes them) and attend only the parts of
each block that share a document (kernels/context_blocks.py).

Tensors are [B, S, H, D]; keys/values may have fewer heads (GQA). Plain PyTorch and
torch.distributed: the same code runs on gloo and nccl.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol

from dtmega.kernels.allgather_attention import AllGatherAttention
from dtmega.kernels.context_blocks import ContextBlocks, causal_blocks, document_blocks
from dtmega.kernels.context_shards import CommStats, token_indices
from dtmega.kernels.document_attention import document_attention, document_mask
from dtmega.kernels.document_shards import shard_documents
from dtmega.kernels.errors import DtmegaError
from dtmega.kernels.ring_attention import RingAttention

METHODS = ("ring", "all_gather", "a2a")


def _count_backward(tensor: torch.Tensor, stats: CommStats | None, world: int) -> None:
    """The backward of an all-to-all sends (world-1)/world of the incoming gradient."""
    if stats is not None and tensor.requires_grad:
        def count(grad):
            stats.bytes_sent += grad.numel() * grad.element_size() * (world - 1) // world
        tensor.register_hook(count)


def _to_heads(t: torch.Tensor, group, world: int, stats) -> torch.Tensor:
    """[B, S/cp, H, D] sequence shard -> [B, S, H/cp, D] head shard (sequence in rank order)."""
    b, s, h, d = t.shape
    chunks = t.view(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    if stats is not None:
        stats.add(chunks, 1)
        stats.bytes_sent -= chunks.numel() // world * chunks.element_size()  # the own chunk stays
    moved = funcol.all_to_all_single(chunks.flatten(0, 1), None, None, group)
    _count_backward(moved, stats, world)
    return moved.view(world, b, s, h // world, d).permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)


def _to_sequence(t: torch.Tensor, group, world: int, stats) -> torch.Tensor:
    """Inverse of `_to_heads`."""
    b, full, hh, d = t.shape
    s = full // world
    chunks = t.view(b, world, s, hh, d).permute(1, 0, 2, 3, 4).contiguous()
    if stats is not None:
        stats.add(chunks, 1)
        stats.bytes_sent -= chunks.numel() // world * chunks.element_size()
    moved = funcol.all_to_all_single(chunks.flatten(0, 1), None, None, group)
    _count_backward(moved, stats, world)
    return moved.view(world, b, s, hh, d).permute(1, 2, 0, 3, 4).reshape(b, s, world * hh, d)


def _a2a_attention(q, k, v, seq_len, group, zigzag, causal, scale, stats, documents=None, document_backend=None):
    world = dist.get_world_size(group)
    h, kvh = q.shape[2], k.shape[2]
    if h % world:
        raise ValueError(f"a2a context parallelism needs attention heads ({h}) divisible by cp ({world})")
    if kvh % world:  # too few key/value heads to split: give each query head its own
        k, v = k.repeat_interleave(h // kvh, dim=2), v.repeat_interleave(h // kvh, dim=2)
    qh, kh, vh = (_to_heads(t, group, world, stats) for t in (q, k, v))
    # The gathered sequence is in rank order; in token order the mask is plain causal (no mask
    # tensor, the fused kernel), so reorder around the attention when shards are zigzag.
    order = torch.cat([token_indices(seq_len, world, r, zigzag, q.device) for r in range(world)])
    if zigzag:
        natural = torch.argsort(order)
        qh, kh, vh = (t.index_select(1, natural) for t in (qh, kh, vh))
    if documents is not None:
        # packed documents: every rank's ids (a few bytes per token), in token order, make the
        # whole sequence's mask; each rank attends all of it for its share of the heads
        ids = funcol.all_gather_tensor(documents.contiguous(), 1, group).contiguous()
        if zigzag:
            ids = ids.index_select(1, natural)
        out = document_attention(qh, kh, vh, document_mask(ids, document_backend), scale)
        if zigzag:
            out = out.index_select(1, order)
        return _to_sequence(out, group, world, stats)
    out = F.scaled_dot_product_attention(
        qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), is_causal=causal, scale=scale,
        enable_gqa=qh.shape[2] != kh.shape[2],
    ).transpose(1, 2)
    if zigzag:
        out = out.index_select(1, order)
    return _to_sequence(out, group, world, stats)


def sharded_document_blocks(documents: torch.Tensor, group, balanced: bool) -> ContextBlocks:
    """The blocks of packed samples whose tokens `SequenceSharding` dealt to the ranks of
    `group`: `documents` is this rank's [B, S/cp] ids, each its document's start position."""
    world = dist.get_world_size(group)
    gathered = funcol.all_gather_tensor(documents.contiguous(), 0, group).view(world, *documents.shape).cpu()
    seq_len = documents.shape[1] * world
    positions = []
    for b in range(documents.shape[0]):
        starts = torch.unique(gathered[:, b]).tolist()
        if starts[0] != 0 or starts[-1] >= seq_len:
            raise DtmegaError("packed documents reached blockwise context-parallel attention with ids that are not "
                              "their documents' start positions. Fix: shard the batch with the plan's hooks "
                              "(ParallelModel.shard_batch / forward_backward), which write them")
        lengths = [end - start for start, end in zip(starts, [*starts[1:], seq_len])]
        dealt = shard_documents(lengths, world, balanced).positions
        start_of = torch.repeat_interleave(torch.tensor(starts), torch.tensor(lengths))
        if not torch.equal(start_of[dealt], gathered[:, b].long()):
            raise DtmegaError("the tokens of a packed sample are not on the context-parallel ranks the document-aware "
                              "sharding puts them. Fix: shard the batch with the plan's hooks "
                              "(ParallelModel.shard_batch / forward_backward)")
        positions.append(dealt)
    positions = torch.stack(positions, dim=1)  # [world, B, S/cp]
    return document_blocks(positions, gathered.long())


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, method: str = "ring", zigzag: bool = True,
    causal: bool = True, scale: float | None = None, stats: CommStats | None = None, fused: bool | None = None,
    documents: torch.Tensor | None = None, document_backend: str | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale [+ causal mask]) v over the whole sequence, each rank passing its
    shard of q, k, v ([B, S/cp, H, D], GQA allowed) and getting its shard of the output.

    `stats` counts the bytes this rank sends (and the blocks ring/all-gather attend or skip).
    `fused` (ring, all_gather) picks the block kernel: None for the fused one where the device
    has it, False for the plain-PyTorch reference. `documents`: this rank's document ids of
    packed sequences ([B, S/cp]); attention is then causal within each document: a2a masks with
    `document_backend`; ring and all-gather need the ids to be each document's start position
    and the tokens dealt by `kernels.document_shards.shard_documents` (balanced when `zigzag`),
    as `SequenceSharding` does."""
    world = dist.get_world_size(group)
    seq_len = q.shape[1] * world
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if method in ("ring", "all_gather"):
        if v.shape[-1] != k.shape[-1]:  # MLA: values narrower than queries/keys travel padded with keys
            width = v.shape[-1]
            padded = F.pad(v, (0, k.shape[-1] - width))
            return context_parallel_attention(q, k, padded, group=group, method=method, zigzag=zigzag, causal=causal,
                                              scale=scale, stats=stats, fused=fused, documents=documents,
                                              document_backend=document_backend)[..., :width]
        if documents is not None:
            blocks = sharded_document_blocks(documents, group, zigzag)
        else:
            blocks = causal_blocks(seq_len, world, zigzag, causal, q.device)
        kernel = RingAttention if method == "ring" else AllGatherAttention
        heads_first = (t.transpose(1, 2) for t in (q, k, v))
        return kernel.apply(*heads_first, blocks, group, scale, stats, fused).transpose(1, 2)
    if method == "a2a":
        return _a2a_attention(q, k, v, seq_len, group, zigzag, causal, scale, stats, documents, document_backend)
    raise ValueError(f"context-parallel method {method!r} is unknown; use one of {METHODS}")
