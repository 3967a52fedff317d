"""A split that training never reads never blocks a run: Megatron's default --split 969,30,1 on a
small corpus leaves a test part shorter than one sample (a fine-tune's few documents)."""

from __future__ import annotations

import numpy as np
import pytest

from dtmega.data.indexed import IndexedDatasetWriter
from dtmega.train.trainer import train
from tests.train_helpers import tiny_args


def test_a_test_part_shorter_than_a_sample_does_not_stop_training(tmp_path):
    """1,000 documents: --split 969,30,1 puts only the last (6 tokens) in the test part, less than
    one 33-token sample; the run trains and validates."""
    prefix = str(tmp_path / "small_text_document")
    writer = IndexedDatasetWriter(prefix, np.uint16)
    rng = np.random.RandomState(0)
    for index in range(1000):
        length = 5 if index == 999 else 40
        writer.add_document([np.append(rng.randint(0, 256, size=length), 256)])  # byte ids, end-of-document
    writer.finalize()
    result = train(tiny_args(prefix, split="969,30,1", train_iters=2, eval_interval=2, eval_iters=1))
    assert len(result.losses) == 2 and result.validation


def test_every_validation_says_it_runs_in_the_log(tmp_path, capfd):
    """A progress line when each validation starts (then every few seconds, and at its end): a
    long final validation in a log file is never silent."""
    from tests.train_helpers import prepare_corpus

    corpus = prepare_corpus(tmp_path, documents=120)
    train(tiny_args(corpus, train_iters=4, eval_interval=2, eval_iters=2))
    err = capfd.readouterr().err
    assert "validation at step 2" in err and "validation at step 4" in err


def test_evaluate_says_when_the_held_out_data_is_read_more_than_once(tmp_path, capsys):
    """`dtmega evaluate --eval-iters N` on held-out data smaller than N batches repeats samples;
    before, without a word. Now a note says how many distinct samples there are and which
    --eval-iters reads each at most once."""
    from dtmega.train.evaluate import main
    from tests.train_helpers import prepare_corpus

    corpus = prepare_corpus(tmp_path, documents=60)
    save = tmp_path / "ckpt"
    train(tiny_args(corpus, train_iters=2, eval_iters=0, save=str(save)))
    capsys.readouterr()
    main(["--load", str(save), "--data-path", corpus, "--split", "0,1,0", "--eval-iters", "400"])
    out = capsys.readouterr().out
    assert "note: the held-out data holds" in out and "read some of them more than once" in out
    main(["--load", str(save), "--data-path", corpus, "--split", "0,1,0", "--eval-iters", "1"])
    assert "note: the held-out data" not in capsys.readouterr().out


def test_data_cache_path_holds_the_sample_indices(tmp_path):
    """Megatron's --data-cache-path: the indices built from the data go there, none beside the
    data (a corpus on a read-only file system), and a second run reuses them."""
    from tests.train_helpers import prepare_corpus

    corpus = prepare_corpus(tmp_path / "data", documents=120)
    cache = tmp_path / "cache"
    first = train(tiny_args(corpus, train_iters=2, eval_iters=1, eval_interval=2, data_cache_path=str(cache)))
    built = sorted(p.relative_to(cache) for p in cache.rglob("*.npy"))
    assert built and not list((tmp_path / "data").rglob("*.dtmega-index"))
    again = train(tiny_args(corpus, train_iters=2, eval_iters=1, eval_interval=2, data_cache_path=str(cache)))
    assert again.losses == pytest.approx(first.losses, rel=1e-6)
    assert sorted(p.relative_to(cache) for p in cache.rglob("*.npy")) == built
