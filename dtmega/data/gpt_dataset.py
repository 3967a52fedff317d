"""GPT pretraining samples in Megatron-Core's order: `seq_length + 1` token windows over the
shuffled sequences of a split, read in a shuffled order.

Megatron-Core's GPTDataset (megatron/core/datasets/gpt_dataset.py, 0.16), step for step, so that
`dtmega train --data-path X --seed S` reads Megatron's samples in Megatron's order:

- a split is a range of *sequences* of the indexed dataset (a document written by `dtmega
  preprocess` is one sequence), bounded by Megatron's split matrix (`split_bounds`);
- the epochs are as many as the requested samples need (`epochs_for`); one `RandomState(seed)`
  shuffles all epochs' sequences as one array (empty ones included) and then, continuing the same
  generator, the sample order; when the last epoch would be used less than 80 %, it is shuffled
  apart from the others (both the sequences and the samples), so the full epochs come first;
- sample k is the tokens at k * seq_length .. (k + 1) * seq_length of the shuffled stream (each
  window overlaps the next by one token, so every token is a label once); the dataset holds every
  sample of its epochs, (epochs x tokens - 1) // seq_length, and position p reads sample
  shuffle[p].

Everything is a deterministic function of (data, split, seq_length, samples, seed), built once by
rank 0, cached on disk, and memory-mapped by every rank. Megatron's own index files are not read
or written; the order is the same (tests/unit/test_megatron_sample_order.py holds it equal to
megatron-core's GPTDataset and BlendedDataset).
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

FINAL_EPOCH_THRESHOLD = 0.80  # Megatron's: a final epoch used less than this is shuffled apart


class DatasetTooSmallError(DtmegaError):
    """The data cannot provide a single sample of the requested length."""


class SampleIndexTooLargeError(DtmegaError):
    """The samples a run asks for need an index larger than the machine's memory can hold."""


def split_bounds(split: list[float], num_sequences: int) -> list[tuple[int, int] | None]:
    """Sequence ranges [lo, hi) of train/valid/test for split weights such as [969, 30, 1], as
    Megatron's split matrix gives them (cumulative shares, each end rounded; a split of weight 0
    is None: Megatron builds no dataset for it)."""
    if len(split) != 3 or any(w < 0 for w in split) or sum(split) <= 0:
        raise DtmegaError(f"--split needs three non-negative weights with a positive sum, got {split}")
    total = float(np.sum(np.array(split, dtype=np.float64)))
    shares = (np.array(split, dtype=np.float64) / total).tolist()
    ends = [0.0]
    for share in shares:
        ends.append(ends[-1] + share)
    bounds: list[tuple[int, int] | None] = []
    for lo, hi in zip(ends[:-1], ends[1:]):
        if hi <= lo:
            bounds.append(None)
        else:
            bounds.append((int(round(lo * float(num_sequences))), int(round(hi * float(num_sequences)))))
    return bounds


def epochs_for(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """Megatron's epoch count: enough epochs for `num_samples` windows of seq_length + 1 tokens
    (one epoch when no count is asked: a dataset of one epoch)."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def samples_in(epochs: int, tokens_per_epoch: int, seq_length: int) -> int:
    """Windows in `epochs` epochs (the last partial one dropped)."""
    return (epochs * tokens_per_epoch - 1) // seq_length


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
    """Everything a sample index depends on (hashed into the cache name). `num_samples` None:
    one epoch (Megatron's mid-level datasets of a blend without weights)."""

    prefix: str
    split_name: str
    sequences: tuple[int, int]  # the split's sequence range [lo, hi)
    seq_length: int
    num_samples: int | None
    seed: int
    data_identity: str = ""  # IndexedDataset.identity: another corpus under the same prefix gets its own index
    cache_dir: str | None = None  # --data-cache-path: where the index goes (default: beside the data); not hashed

    def cache_path(self) -> Path:
        hashed = {k: v for k, v in self.__dict__.items() if k != "cache_dir"}
        hashed["order"] = "megatron-core-0.16"  # indices of the earlier order live under other names
        key = hashlib.sha1(json.dumps(hashed, sort_keys=True).encode()).hexdigest()[:16]
        if self.cache_dir is None:
            return Path(f"{self.prefix}.dtmega-index") / f"{self.split_name}-{key}"
        return Path(self.cache_dir) / f"{Path(self.prefix).name}.dtmega-index" / f"{self.split_name}-{key}"


@dataclass(frozen=True)
class SplitSize:
    """A split's size as the index will have it, from the `.idx` alone: tokens per epoch,
    epochs, and the samples the dataset holds."""

    tokens_per_epoch: int
    epochs: int
    samples: int


def split_size(data: IndexedDataset, spec: GPTDatasetSpec) -> SplitSize:
    """The split's size, refusing one shorter than one sample with DatasetTooSmallError. Reads
    the index only: the dry run calls it to give the launch's verdict without building anything."""
    lo, hi = spec.sequences
    tokens_per_epoch = int(data.sequence_lengths[lo:hi].sum(dtype=np.int64))
    if tokens_per_epoch < spec.seq_length + 1:
        raise DatasetTooSmallError(
            f"the {spec.split_name} split of {spec.prefix} has {tokens_per_epoch} tokens "
            f"({hi - lo} documents), fewer than one sample of --seq-length {spec.seq_length} + 1. "
            "Fix: use more data, a shorter --seq-length, or a --split that gives this split more"
        )
    epochs = epochs_for(tokens_per_epoch, spec.num_samples, spec.seq_length)
    return SplitSize(tokens_per_epoch, epochs, samples_in(epochs, tokens_per_epoch, spec.seq_length))


INDEX_BYTES_PER_SEQUENCE = 4 + 8 + 8  # the document order (int32), its starts (int64), their int64 temporary
INDEX_BYTES_PER_SAMPLE = 8  # the shuffle (at most int64)


def _memory_bytes() -> int:
    """This machine's physical memory (what a sample index must fit in while it is built)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def check_index_fits(data: IndexedDataset, spec: GPTDatasetSpec) -> None:
    """Refuses a split whose sample index would not fit in half this machine's memory, from the
    sizes alone, before anything is built: `--train-iters 10^12` grew the index until memory ran
    out (matrix 3, A4). A launch checks it at start-up; a dry run, which plans for another
    machine and builds nothing, does not."""
    size, sequences = split_size(data, spec), spec.sequences[1] - spec.sequences[0]
    needed = size.epochs * sequences * INDEX_BYTES_PER_SEQUENCE + size.samples * INDEX_BYTES_PER_SAMPLE
    budget = _memory_bytes() // 2
    if needed > budget:
        raise SampleIndexTooLargeError(
            f"the {spec.split_name} split of {spec.prefix} is asked for {spec.num_samples:,} samples: "
            f"{size.epochs:,} epochs of its {sequences:,} documents, whose sample index takes "
            f"{needed / 2**30:,.1f} GiB, more than half this machine's {budget * 2 / 2**30:,.0f} GiB of memory. "
            "Fix: fewer --train-iters (or --train-samples), a larger --eval-interval or fewer --eval-iters, "
            "or more data")


def _document_index(sequences: np.ndarray, epochs: int, rng: np.random.RandomState, separate_final: bool) -> np.ndarray:
    """Every epoch's sequences as one shuffled int32 array (Megatron's document index); the final
    epoch shuffled on its own after the others when `separate_final`."""
    if not separate_final or epochs == 1:
        index = np.tile(sequences.astype(np.int32), epochs)
        rng.shuffle(index)
        return index
    first = _document_index(sequences, epochs - 1, rng, False)
    last = _document_index(sequences, 1, rng, False)
    return np.concatenate((first, last))


def _shuffle_index(first_part: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, first_part) then of [first_part, total), each shuffled in turn by
    the same generator (Megatron's shuffle index)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(first_part, dtype=dtype)
    rng.shuffle(first)
    if first_part == total:
        return first
    last = np.arange(first_part, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


class GPTDataset:
    """Megatron's samples of one split of an indexed dataset: position p is sample shuffle[p]."""

    def __init__(self, data: IndexedDataset, spec: GPTDatasetSpec):
        self.data, self.spec = data, spec
        self.size = split_size(data, spec)
        check_index_fits(data, spec)
        self.index = cached_index(spec.cache_path(), self._build)
        self.lengths = data.sequence_lengths

    def _build(self) -> dict[str, np.ndarray]:
        spec, size = self.spec, self.size
        lo, hi = spec.sequences
        sequences = np.arange(lo, hi, dtype=np.int32)
        separate_final, before_final = False, size.samples
        if size.epochs > 1:
            before_final = samples_in(size.epochs - 1, size.tokens_per_epoch, spec.seq_length)
            per_epoch = (size.tokens_per_epoch - 1) // spec.seq_length
            separate_final = (spec.num_samples - before_final) < int(FINAL_EPOCH_THRESHOLD * per_epoch)
        rng = np.random.RandomState(spec.seed)
        order = _document_index(sequences, size.epochs, rng, separate_final)
        starts = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(self.data.sequence_lengths[order].astype(np.int64), out=starts[1:])
        shuffle = _shuffle_index(before_final if separate_final else size.samples, size.samples, rng)
        return {"order": order, "starts": starts, "shuffle": shuffle}

    def __len__(self) -> int:
        return len(self.index["shuffle"])

    @property
    def samples_per_epoch(self) -> int:
        """Distinct samples before a repeat (one epoch's windows)."""
        return (self.size.tokens_per_epoch - 1) // self.spec.seq_length

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample at position `i`: seq_length + 1 token ids (int64)."""
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
