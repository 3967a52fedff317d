"""Megatron's --mock-data: synthetic samples of the run's shape, without data files.

For trying a launch line (speed, memory, a plan) before the data is ready: sample `i` of a split
is seq_length + 1 token ids drawn uniformly from the tokenizer's ids other than end-of-document,
from a generator seeded by (seed, split, i), so every rank, restart and data-parallel size reads
the same samples. The loss cannot fall below ln(vocabulary): there is nothing to learn.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SPLIT_SEEDS = {"train": 0, "valid": 1, "test": 2}


@dataclass(frozen=True)
class MockDataset:
    """`num_samples` synthetic samples of `seq_length + 1` ids below `vocab_size` (never `eod`)."""

    split: str
    num_samples: int
    seq_length: int
    vocab_size: int
    eod: int
    seed: int

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, SPLIT_SEEDS[self.split], int(i)))
        ids = rng.integers(0, self.vocab_size - 1, size=self.seq_length + 1, dtype=np.int64)
        return ids + (ids >= self.eod)  # skip the end-of-document id


def mock_datasets(num_samples: dict[str, int], seq_length: int, vocab_size: int, eod: int,
                  seed: int) -> dict[str, MockDataset | None]:
    """train/valid(/test) mock datasets of the sizes asked (None where none are asked)."""
    return {split: MockDataset(split, count, seq_length, vocab_size, eod, seed) if count > 0 else None
            for split, count in num_samples.items()}
