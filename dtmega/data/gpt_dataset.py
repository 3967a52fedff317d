"""GPT pretraining samples: `seq_length + 1` token windows over shuffled documents.

As Megatron's GPTDataset does: the split's documents are shuffled anew for every epoch and
concatenated, samples are consecutive windows of the stream that cross document boundaries
(each window overlaps the next by one token, so every token is a label once), and the samples
are shuffled. Everything is a deterministic function of (data, split, seq_length, seed), built
once by rank 0, cached on disk beside the data, and memory-mapped by every rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch.distributed as dist

from dtmega.data.indexed import IndexedDataset
from dtmega.kernels.errors import DtmegaError


class DatasetTooSmallError(DtmegaError):
    """The data cannot provide a single sample of the requested length."""


def split_documents(split: list[float], num_documents: int) -> list[tuple[int, int]]:
    """Document ranges [lo, hi) of train/valid/test for split weights such as [969, 30, 1]."""
    if len(split) != 3 or any(w < 0 for w in split) or sum(split) <= 0:
        raise DtmegaError(f"--split needs three non-negative weights with a positive sum, got {split}")
    total = sum(split)
    bounds = [0]
    for weight in split:
        bounds.append(bounds[-1] + int(round(weight / total * num_documents)))
    overshoot = bounds[-1] - num_documents
    bounds = [max(0, b - overshoot) if i else 0 for i, b in enumerate(bounds)]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def cached_index(path: Path, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Arrays built once (by global rank 0, written atomically) and memory-mapped everywhere."""
    leader = not dist.is_initialized() or dist.get_rank() == 0
    if leader and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = build()
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", array)
        if path.exists():  # another job built it meanwhile
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    return {f.stem: np.load(f, mmap_mode="r") for f in sorted(path.glob("*.npy"))}


@dataclass(frozen=True)
class GPTDatasetSpec:
    """Everything a sample index depends on (hashed into the cache name)."""

    prefix: str
    split_name: str
    documents: tuple[int, int]
    seq_length: int
    num_samples: int
    seed: int
    data_identity: str = ""  # IndexedDataset.identity: another corpus under the same prefix gets its own index
    cache_dir: str | None = None  # --data-cache-path: where the index goes (default: beside the data); not hashed

    def cache_path(self) -> Path:
        hashed = {k: v for k, v in self.__dict__.items() if k != "cache_dir"}
        key = hashlib.sha1(json.dumps(hashed, sort_keys=True).encode()).hexdigest()[:16]
        if self.cache_dir is None:
            return Path(f"{self.prefix}.dtmega-index") / f"{self.split_name}-{key}"
        return Path(self.cache_dir) / f"{Path(self.prefix).name}.dtmega-index" / f"{self.split_name}-{key}"


def split_sequences(data: IndexedDataset, spec: GPTDatasetSpec) -> tuple[np.ndarray, int]:
    """(the split's non-empty sequence indices, its tokens per epoch), refusing a split shorter
    than one sample with DatasetTooSmallError. Reads the index only: the dry run calls it to give
    the launch's verdict without building anything."""
    lo, hi = spec.documents
    first, last = int(data.document_indices[lo]), int(data.document_indices[hi])
    sequences = np.arange(first, last, dtype=np.int64)
    sequences = sequences[data.sequence_lengths[first:last] > 0]
    tokens_per_epoch = int(data.sequence_lengths[sequences].sum(dtype=np.int64))
    if tokens_per_epoch < spec.seq_length + 1:
        raise DatasetTooSmallError(
            f"the {spec.split_name} split of {spec.prefix} has {tokens_per_epoch} tokens "
            f"({hi - lo} documents), fewer than one sample of --seq-length {spec.seq_length} + 1. "
            "Fix: use more data, a shorter --seq-length, or a --split that gives this split more"
        )
    return sequences, tokens_per_epoch


class GPTDataset:
    """`num_samples` windows of `seq_length + 1` tokens from one split of an indexed dataset."""

    def __init__(self, data: IndexedDataset, spec: GPTDatasetSpec):
        self.data, self.spec = data, spec
        sequences, tokens_per_epoch = split_sequences(data, spec)
        self.index = cached_index(spec.cache_path(), lambda: self._build(sequences, tokens_per_epoch))
        self.lengths = data.sequence_lengths
        self.samples_per_epoch = (tokens_per_epoch - 1) // spec.seq_length  # distinct samples before a repeat

    def _build(self, sequences: np.ndarray, tokens_per_epoch: int) -> dict[str, np.ndarray]:
        spec = self.spec
        needed = spec.num_samples * spec.seq_length + 1
        epochs = max(1, -(-needed // tokens_per_epoch))
        rng = np.random.RandomState(spec.seed)
        order = np.concatenate([rng.permutation(sequences) for _ in range(epochs)])
        starts = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(self.data.sequence_lengths[order].astype(np.int64), out=starts[1:])
        available = int((starts[-1] - 1) // spec.seq_length)
        samples = min(spec.num_samples, available)
        shuffle = np.random.RandomState(spec.seed + 1).permutation(samples).astype(np.int64)
        return {"order": order, "starts": starts, "shuffle": shuffle}

    def __len__(self) -> int:
        return len(self.index["shuffle"])

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample `i`: seq_length + 1 token ids (int64)."""
        order, starts = self.index["order"], self.index["starts"]
        begin = int(self.index["shuffle"][i]) * self.spec.seq_length
        want = self.spec.seq_length + 1
        position = int(np.searchsorted(starts, begin, side="right")) - 1
        offset = begin - int(starts[position])
        pieces = []
        while want > 0:
            sequence = int(order[position])
            piece = self.data.get(sequence, offset, min(want, int(self.lengths[sequence]) - offset))
            pieces.append(piece)
            want -= len(piece)
            position, offset = position + 1, 0
        return np.concatenate(pieces).astype(np.int64)
