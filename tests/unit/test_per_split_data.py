"""Megatron's --train-data-path, --valid-data-path and --test-data-path: each split from its own
datasets, every document of them (--split is not read).

Semantics against what they spell with --data-path: training on --train-data-path A gives the
losses of --data-path A --split 100,0,0 (the same documents, the same sample order: equal), the
validation samples are those of B's whole document range, and --test-data-path is evaluated
once at the end. Contradicting data flags are refused by a dry run, naming the flag to drop."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dtmega.data.blend import DataConfig, build_datasets
from dtmega.train.args import ArgumentError
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("per_split")
    return prepare_corpus(root / "a", documents=120), prepare_corpus(root / "b", documents=40)


def _run(data_flags: dict, tmp_path, **flags):
    return train(tiny_args(None, train_iters=4, log_interval=1, eval_interval=2, eval_iters=1,
                           log_file=str(tmp_path / "m.jsonl"), **{"data_path": None, **data_flags, **flags}))


def test_train_data_path_trains_on_every_document_of_it(corpora, tmp_path):
    a, b = corpora
    per_split = _run(dict(train_data_path=a, valid_data_path=b, split=None), tmp_path)
    whole = _run(dict(data_path=a, split="100,0,0"), tmp_path)
    assert per_split.losses == whole.losses
    assert [step for step, _ in per_split.validation] == [2, 4] and not whole.validation


def test_the_validation_split_is_the_whole_of_its_own_data(corpora):
    a, b = corpora
    ours = build_datasets(DataConfig((), seq_length=32, seed=11, per_split=((a,), (b,), ())), {"train": 8, "valid": 8})
    theirs = build_datasets(DataConfig((b,), (0.0, 1.0, 0.0), 32, 11), {"valid": 8})["valid"]
    assert ours["test"] is None and len(ours["valid"]) == len(theirs)
    for i in range(len(theirs)):
        assert np.array_equal(ours["valid"][i], theirs[i])


def test_test_data_path_is_evaluated_once_at_the_end(corpora, tmp_path):
    a, b = corpora
    result = _run(dict(train_data_path=a, valid_data_path=b, test_data_path=b, split=None), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    tested = [r for r in records if "test_loss" in r]
    assert [r["step"] for r in tested] == [4] and tested[0]["test_loss"] == pytest.approx(result.test_loss)
    # the test data is the validation data here, but each validation reads on where the last one
    # stopped (Megatron's validation iterator) while the test reads its own first batches
    assert [step for step, _ in result.validation] == [2, 4] and result.test_loss > 0


@pytest.mark.parametrize("flags, message", [
    (dict(train_data_path="A"), r"--data-path and --train/valid/test-data-path both say.*Fix: keep one"),
    (dict(data_path=None, valid_data_path="B"), r"without --train-data-path.*Fix: add --train-data-path"),
    (dict(data_path=None), r"needs data: --data-path .*--train-data-path.*--mock-data"),
    (dict(mock_data=True), r"--data-path and --mock-data both say.*Fix: keep one"),
])
def test_contradicting_data_flags_are_refused_by_a_dry_run(corpora, flags, message):
    with pytest.raises(ArgumentError, match=message):
        train(tiny_args(corpora[0], dry_run=1, **flags))


def test_split_and_a_missing_validation_path_get_notes(corpora, capsys):
    train(tiny_args(None, dry_run=1, train_data_path=corpora[0], split="99,1,0"))
    out = capsys.readouterr().out
    assert "--split 99,1,0 is not read" in out and "no --valid-data-path: this run has no validation" in out
