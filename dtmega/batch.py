"""Training batches: a `TensorDict` of [B, S] tensors (tokens, labels, loss_mask, position_ids).

Dim 0 is split across data-parallel ranks and into micro-batches, dim 1 across context-parallel
ranks: each is one TensorDict call.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from dtmega.kernels.errors import DtmegaError
from dtmega.passes.runtime import Batch  # noqa: F401  (the unpacked batch; defined with the runtime protocol)

REQUIRED = ("tokens", "labels")
OPTIONAL = ("loss_mask", "position_ids")


def make_batch(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **extra: torch.Tensor,
) -> TensorDict:
    """A batch TensorDict from [B, S] tensors; `extra` per-token fields a plan's passes or loss
    read (e.g. `document_ids=...`)."""
    fields = {"tokens": tokens, "labels": labels}
    if loss_mask is not None:
        fields["loss_mask"] = loss_mask
    if position_ids is not None:
        fields["position_ids"] = position_ids
    fields.update(extra)
    return TensorDict(fields, batch_size=list(tokens.shape[:2]))


def synthetic_batch(
    batch_size: int, seq_len: int, vocab_size: int, *, seed: int = 0, device: str | torch.device = "cpu",
    masked_fraction: float = 0.0,
) -> TensorDict:
    """Random tokens with next-token labels (and optionally a random loss mask), for tests,
    examples and benchmarks. The same seed gives the same batch on every rank."""
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator)
    mask = (torch.rand(batch_size, seq_len, generator=generator) >= masked_fraction).float()
    mask[:, 0] = 1.0  # never an all-masked row
    return make_batch(stream[:, :-1], stream[:, 1:], mask).to(device)


def unpack_batch(batch: TensorDict, vocab_size: int | None = None, fields: tuple[str, ...] = ()) -> Batch:
    """Validates `batch` and returns its fields (loss_mask defaults to all ones); `fields`: the
    per-token fields beyond the four the plan reads, which the batch must carry (and no others)."""
    if not isinstance(batch, TensorDict):
        raise TypeError(
            f"batch must be a tensordict.TensorDict with batch_size=[B, S], got {type(batch).__name__}. "
            "Fix: dtmega.make_batch(tokens, labels)"
        )
    missing = [key for key in REQUIRED if key not in batch.keys()]
    if missing:
        raise KeyError(f"batch is missing {missing}; it needs 'tokens' and 'labels' (and may have {OPTIONAL})")
    if len(batch.batch_size) != 2:
        raise DtmegaError(f"batch.batch_size must be [B, S], got {list(batch.batch_size)}")
    tokens, labels = batch["tokens"], batch["labels"]
    for name, tensor in (("tokens", tokens), ("labels", labels)):
        if tensor.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"batch[{name!r}] must hold integer token ids, got {tensor.dtype}")
        if vocab_size is not None and tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= vocab_size):
            raise DtmegaError(
                f"batch[{name!r}] holds ids in [{int(tensor.min())}, {int(tensor.max())}] but the model's "
                f"vocabulary is [0, {vocab_size}). Fix: tokenize with a vocabulary no larger than the model's"
            )
    known = set(REQUIRED) | set(OPTIONAL)
    missing = [name for name in fields if name not in batch.keys()]
    if missing:
        raise KeyError(f"batch lacks {missing}, which this plan's passes or loss read. Fix: "
                       f"dtmega.make_batch(tokens, labels, ..., {missing[0]}=...)")
    unused = [name for name in batch.keys() if name not in known and name not in fields]
    if unused:
        raise KeyError(f"batch field(s) {unused} are read by no pass or loss of this plan (it reads "
                       f"{sorted(known | set(fields))}). Fix: leave them out, or add the pass that uses them")
    loss_mask = batch.get("loss_mask", None)
    if loss_mask is None:
        loss_mask = torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)
    position_ids = batch.get("position_ids", None)
    return Batch(tokens.long(), labels.long(), loss_mask.float(), None if position_ids is None else position_ids.long(),
                 {name: batch[name] for name in fields})
