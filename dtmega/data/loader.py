"""Batches for one data-parallel rank, resumable from a sample count."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from tensordict import TensorDict

from dtmega.batch import make_batch
from dtmega.kernels.document_attention import document_ids_from_eod
from dtmega.kernels.errors import DtmegaError


def sample_to_fields(samples: np.ndarray, eod: int, eod_mask_loss: bool, reset_position_ids: bool,
                     reset_attention_mask: bool = False) -> TensorDict:
    """[B, S+1] token windows -> tokens, labels, loss_mask, position_ids ([B, S] each), and with
    `reset_attention_mask` the document_ids that mask attention per document (Megatron's GPT
    dataset: a document ends with its end-of-document token; the next token starts another)."""
    data = torch.from_numpy(np.ascontiguousarray(samples))
    tokens, labels = data[:, :-1], data[:, 1:]
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape).clone()
    if reset_position_ids:
        # A position right after an end-of-document starts a new document at 0.
        starts = torch.zeros_like(tokens, dtype=torch.bool)
        starts[:, 1:] = tokens[:, :-1] == eod
        segment_start = torch.where(starts, positions, torch.zeros_like(positions)).cummax(dim=1).values
        positions = positions - segment_start
    if reset_attention_mask:
        documents = document_ids_from_eod(tokens, eod)
        return make_batch(tokens.contiguous(), labels.contiguous(), loss_mask, positions, document_ids=documents)
    return make_batch(tokens.contiguous(), labels.contiguous(), loss_mask, positions)


class BatchLoader:
    """Global batch g covers positions [g*G, (g+1)*G), dealt to the data-parallel ranks as
    Megatron's pretraining sampler deals them: each run of micro_batch x dp positions gives rank
    r its micro_batch positions at r x micro_batch (so micro-batch m of rank r holds positions
    g*G + m*micro_batch*dp + r*micro_batch ...; with one micro-batch per rank, its contiguous
    1/dp slice). The position is `consumed_samples`, so a resumed run reads exactly what it would
    have. `order` maps a position to a dataset index (sample_order.py's CyclicOrder for
    `--dataloader-type cyclic`, which never runs out); by default position p is sample p."""

    def __init__(self, dataset, global_batch: int, dp_rank: int, dp_size: int, *, eod: int,
                 eod_mask_loss: bool = False, reset_position_ids: bool = False, consumed_samples: int = 0,
                 order: Callable[[int], int] | None = None, reset_attention_mask: bool = False,
                 micro_batch: int | None = None):
        if global_batch % dp_size:
            raise DtmegaError(f"global batch {global_batch} is not divisible by {dp_size} data-parallel ranks")
        self.dataset, self.global_batch = dataset, global_batch
        self.dp_rank, self.dp_size, self.local = dp_rank, dp_size, global_batch // dp_size
        self.micro_batch = micro_batch or self.local
        if self.local % self.micro_batch:
            raise DtmegaError(f"a rank's {self.local} sequences per step are not whole micro-batches of {self.micro_batch}")
        self.eod, self.eod_mask_loss, self.reset_position_ids = eod, eod_mask_loss, reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.consumed_samples = consumed_samples
        self.order = order

    def positions(self) -> list[int]:
        """This rank's positions of the next global batch, in micro-batch order."""
        run = self.micro_batch * self.dp_size
        first = self.consumed_samples + self.dp_rank * self.micro_batch
        return [first + m * run + j for m in range(self.local // self.micro_batch) for j in range(self.micro_batch)]

    def __iter__(self):
        return self

    def __next__(self) -> TensorDict:
        if self.order is None and self.consumed_samples + self.global_batch > len(self.dataset):
            raise StopIteration
        order = self.order or int
        samples = np.stack([self.dataset[order(i)] for i in self.positions()])
        self.consumed_samples += self.global_batch
        to_fields = getattr(self.dataset, "to_fields", None)  # a dataset of its own fields (SFT's packed chats)
        if to_fields is not None:
            return to_fields(samples)
        return sample_to_fields(samples, self.eod, self.eod_mask_loss, self.reset_position_ids,
                                self.reset_attention_mask)

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
