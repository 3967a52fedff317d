"""Attention over packed documents: causal within each document, nothing across documents.

A sequence that packs several documents carries a document id per token ([B, S] integers; equal
ids = one document, documents contiguous). Query i may attend to key j when both lie in the same
document and j <= i. Three implementations, chosen by the plan (passes/document_masking.py) and
recorded in the layout:

- "flex": FlexAttention with a BlockMask built once per forward from the document ids, compiled.
  Blocks that are fully masked (a query block and a key block sharing no document) are skipped,
  and no [S, S] tensor exists: the kernel saves q, k, v, its output and log-sum-exp. The plan's
  choice on CUDA. torch 2.13 has no FlexAttention backward on CPU (NotImplementedError), so on
  CPU it serves forward-only use (evaluation, generation of packed prompts).
- "varlen": each document its own causal attention, the variable-length form: on CUDA in
  fp16/bf16 one call of torch's variable-length flash kernel (`torch.nn.attention.varlen`), else
  scaled_dot_product_attention on each document's rows (PyTorch's fused flash kernel on CPU). Nothing masked
  is computed and nothing of size [S, S] exists; it reads the boundaries on the host once per
  layer, so it runs outside compiled graphs. The plan's choice on CPU.
- "sdpa": scaled_dot_product_attention with a dense boolean [B, 1, S, S] mask: the fallback that
  runs everywhere, exact, at the cost of the mask's S² bytes per sequence.

`document_ids_from_lengths` and `document_ids_from_eod` build the ids from cumulative lengths
(the "cu_seqlens" of variable-length kernels) or from end-of-document tokens (Megatron's
`--reset-attention-mask`); `positions_from_documents` restarts positions per document.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from dtmega.kernels.errors import DtmegaError

BACKENDS = ("flex", "varlen", "sdpa")


def default_backend(device_type: str) -> str:
    """"auto": FlexAttention on CUDA, the variable-length path elsewhere (no FlexAttention
    backward on CPU in torch)."""
    return "flex" if device_type == "cuda" else "varlen"


def document_ids_from_lengths(lengths: list[list[int]] | list[int], seq_len: int | None = None) -> torch.Tensor:
    """[B, S] document ids from each row's document lengths ([[3, 5], [8]] -> [[0,0,0,1,1,1,1,1],
    [0]*8]); every row must sum to the same length (`seq_len` when given)."""
    rows = [lengths] if lengths and isinstance(lengths[0], int) else lengths
    out = []
    for index, row in enumerate(rows):
        if any(length < 1 for length in row):
            raise DtmegaError(f"document lengths of row {index} ({row}) must all be >= 1")
        total = sum(row)
        if seq_len is not None and total != seq_len:
            raise DtmegaError(f"the document lengths of row {index} sum to {total}, not the sample length {seq_len}. "
                              "Fix: lengths that cover the sample exactly (pad the last document)")
        out.append(torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)))
    sizes = {len(row) for row in out}
    if len(sizes) != 1:
        raise DtmegaError(f"rows of different lengths {sorted(sizes)}: every row of a batch has the same sample length")
    return torch.stack(out)


def document_ids_from_eod(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Megatron's GPT-dataset boundaries: a new document starts right after each end-of-document
    token (the EOD itself ends the document it closes)."""
    starts = torch.zeros_like(tokens, dtype=torch.long)
    starts[:, 1:] = (tokens[:, :-1] == eod).long()
    return starts.cumsum(dim=1)


def positions_from_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at the start of every document."""
    seq = document_ids.shape[1]
    index = torch.arange(seq, device=document_ids.device).expand(document_ids.shape)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def check_document_ids(document_ids: torch.Tensor, tokens: torch.Tensor) -> None:
    """Document ids the masks can use: integer, the tokens' [B, S], each document one contiguous
    run (ids non-decreasing along the sequence); DtmegaError naming the fix otherwise."""
    if document_ids.shape != tokens.shape:
        raise DtmegaError(f"document_ids has shape {list(document_ids.shape)} but the tokens {list(tokens.shape)}. "
                          "Fix: one document id per token")
    if document_ids.dtype not in (torch.int64, torch.int32):
        raise DtmegaError(f"document_ids must hold integers, got {document_ids.dtype}")
    if document_ids.shape[1] > 1 and bool((document_ids[:, 1:] < document_ids[:, :-1]).any()):
        raise DtmegaError("document_ids decrease inside a sample: each document must be one contiguous run with "
                          "ids rising along the sequence. Fix: dtmega.document_ids_from_lengths(...)")


def dense_document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] boolean mask: True where query i may attend to key j (same document, j <= i)."""
    seq = document_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]


def document_block_mask(document_ids: torch.Tensor, block_size: int = 128):
    """FlexAttention's BlockMask for `document_ids` (heads broadcast): built once per forward,
    it lists for each query block the key blocks that are partly or fully visible; the rest are
    skipped by the kernel."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seq = document_ids.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return (document_ids[b, q_idx] == document_ids[b, kv_idx]) & (kv_idx <= q_idx)

    return create_block_mask(mask_mod, batch, None, seq, seq, device=document_ids.device,
                             BLOCK_SIZE=min(block_size, _round_up(seq)))


def _round_up(seq: int) -> int:
    size = 16
    while size < seq:
        size *= 2
    return size


def document_mask(document_ids: torch.Tensor, backend: str):
    """What a model passes its attention cores for one forward: the dense boolean mask ("sdpa"),
    the BlockMask ("flex"), or the integer ids themselves ("varlen", and "ids": context-parallel
    attention gathers them and builds its own mask for the whole sequence)."""
    if backend in ("ids", "varlen"):
        return document_ids
    if backend == "flex":
        return document_block_mask(document_ids)
    if backend == "sdpa":
        return dense_document_mask(document_ids)
    raise DtmegaError(f"document-masking backend {backend!r} is unknown; use one of {BACKENDS}")


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, *,
                            compiled: bool = True, scale: float | None = None) -> torch.Tensor:
    """FlexAttention over [B, H, S, D] heads (GQA allowed) with a document BlockMask."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex() if compiled else flex_attention
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _flash_varlen():
    """torch's variable-length flash attention (CUDA, fp16/bf16), or None where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def flash_varlen_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor,
                                    scale: float | None = None, varlen_attn=None) -> torch.Tensor:
    """All documents of all rows as one variable-length batch through torch's flash kernel
    (`torch.nn.attention.varlen.varlen_attn`): [B, S, H, D] -> [B*S, H, D] with cumulative
    document lengths, causal within each. torch 2.13 spells causal as window_size=(-1, 0),
    earlier releases as is_causal=True; GQA is passed on where the kernel takes it, else the
    key/value heads are repeated."""
    import inspect

    varlen_attn = varlen_attn or _flash_varlen()
    b, s, h, d = q.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]  # every row starts a document
    first = torch.nonzero(starts.flatten()).flatten().to(torch.int32)
    cu = torch.cat([first, torch.tensor([b * s], dtype=torch.int32, device=first.device)])
    longest = int((cu[1:] - cu[:-1]).max())
    parameters = inspect.signature(varlen_attn).parameters
    options: dict = {"scale": scale}
    options.update({"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True})
    if k.shape[2] != h:
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (k, v))
    out = varlen_attn(q.reshape(b * s, h, d), k.reshape(b * s, k.shape[2], d), v.reshape(b * s, v.shape[2], d),
                      cu, cu, longest, longest, **options)
    return out.view(b, s, h, out.shape[-1])


@torch.compiler.disable
def varlen_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              document_ids: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Each document of each row its own causal attention ([B, S, H, D] heads, GQA allowed):
    on CUDA in fp16/bf16 one call of torch's variable-length flash kernel where torch has it,
    elsewhere SDPA per document (the fused flash kernel on CPU)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _flash_varlen() is not None:
        return flash_varlen_document_attention(q, k, v, document_ids, scale)
    gqa = q.shape[2] != k.shape[2]
    rows = []
    for b in range(q.shape[0]):
        ids = document_ids[b]
        change = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
        bounds = [0, *change, q.shape[1]]
        pieces = [F.scaled_dot_product_attention(
            q[b:b + 1, s:e].transpose(1, 2), k[b:b + 1, s:e].transpose(1, 2), v[b:b + 1, s:e].transpose(1, 2),
            is_causal=True, scale=scale, enable_gqa=gqa).transpose(1, 2) for s, e in zip(bounds[:-1], bounds[1:])]
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float | None = None
                       ) -> torch.Tensor:
    """Attention over [B, S, H, D] heads with what `document_mask` built: a dense boolean mask
    runs SDPA, integer document ids the variable-length path, a BlockMask FlexAttention."""
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        return varlen_document_attention(q, k, v, mask, scale)
    if isinstance(mask, torch.Tensor):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             scale=scale, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)
    return flex_document_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                                   scale=scale).transpose(1, 2)


class DocumentAttentionCore(nn.Module):
    """An attention core for models whose own cores take no document ids (torchtitan's): called
    as torchtitan calls its inner attention ([B, S, H, D] q, k, v; `attention_masks`; `scale`),
    it attends causally within each document when `attention_masks` holds the batch's document
    ids, and causally over the whole sequence when it is None. The mask `backend` makes from the
    ids is built by the first core of a forward and reused by the others (same ids tensor)."""

    def __init__(self, backend: str, shared: dict | None = None):
        super().__init__()
        self.backend = backend
        self._shared = {} if shared is None else shared  # one per model: the last ids and their mask

    def forward(self, q, k, v, *, attention_masks=None, scale=None, is_causal=True, **kwargs) -> torch.Tensor:
        if attention_masks is None:
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=is_causal, scale=scale,
                                                  enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
        if not isinstance(attention_masks, torch.Tensor) or attention_masks.dtype not in (torch.int32, torch.int64):
            raise DtmegaError(f"{type(self).__name__} takes the batch's document ids as attention_masks, got "
                              f"{type(attention_masks).__name__}. Fix: pass document_ids through the plan's batch")
        if self._shared.get("ids") is not attention_masks:
            self._shared.update(ids=attention_masks, mask=document_mask(attention_masks, self.backend))
        return document_attention(q, k, v, self._shared["mask"], scale)

    def extra_repr(self) -> str:
        return f"backend={self.backend}"
