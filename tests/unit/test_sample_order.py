"""`--dataloader-type cyclic` (issue 18): a fresh shuffle of the samples every pass, resumable
from `consumed_samples`, independent of the data-parallel size."""

from __future__ import annotations

import numpy as np
import pytest

from dtmega.data.loader import BatchLoader
from dtmega.data.sample_order import CyclicOrder
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args

SAMPLES, GLOBAL = 22, 4  # 20 usable samples per pass: 5 global batches


class Numbered:
    """A dataset whose sample i is [i, i, i] (tokens), so a batch shows which samples it holds."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(3, index, dtype=np.int64)


def _read(loader: BatchLoader, batches: int) -> list[list[int]]:
    return [next(loader)["tokens"][:, 0].tolist() for _ in range(batches)]


def _cyclic(dp_rank: int = 0, dp_size: int = 1, consumed: int = 0) -> BatchLoader:
    return BatchLoader(Numbered(), GLOBAL, dp_rank, dp_size, eod=0, consumed_samples=consumed,
                       order=CyclicOrder(SAMPLES, GLOBAL, seed=7))


def test_every_pass_is_a_fresh_permutation_of_the_usable_samples():
    batches = _read(_cyclic(), 15)  # three passes of 5 batches
    passes = [[sample for batch in batches[i:i + 5] for sample in batch] for i in (0, 5, 10)]
    for seen in passes:
        assert sorted(seen) == list(range(20))  # every usable sample once; 20 and 21 never
    assert passes[0] != passes[1] != passes[2] and passes[0] != list(range(20))


def test_a_resume_reads_what_the_run_would_have():
    whole = _read(_cyclic(), 12)
    assert _read(_cyclic(consumed=7 * GLOBAL), 5) == whole[7:12]


def test_the_global_batch_does_not_depend_on_the_data_parallel_size():
    one = _read(_cyclic(), 6)
    halves = [_read(_cyclic(dp_rank=r, dp_size=2), 6) for r in (0, 1)]
    assert [a + b for a, b in zip(*halves)] == one


def test_single_never_wraps_and_cyclic_needs_one_global_batch():
    single = BatchLoader(Numbered(), GLOBAL, 0, 1, eod=0)
    assert len(_read(single, 5)) == 5
    with pytest.raises(StopIteration):
        next(single)
    with pytest.raises(ValueError, match="do not fill one global batch of 32"):
        CyclicOrder(SAMPLES, 32, seed=0)


def test_cyclic_training_resumes_with_the_same_losses(tmp_path_factory):
    corpus = prepare_corpus(tmp_path_factory.mktemp("corpus"), documents=120)
    save = tmp_path_factory.mktemp("cyclic") / "ckpt"
    run = {"train_iters": 4, "eval_iters": 0, "log_interval": 1, "dataloader_type": "cyclic"}
    whole = train(tiny_args(corpus, save=str(save), save_interval=2, **run))
    resumed = train(tiny_args(corpus, load=str(save / "iter_0000002"), **run))
    single = train(tiny_args(corpus, **{**run, "dataloader_type": "single"}))
    assert resumed.losses == whole.losses[2:]  # same state, same batches: bit-identical
    assert whole.losses != single.losses  # another order of the same data
