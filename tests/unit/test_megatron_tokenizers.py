"""The tokenizer types Megatron's launch scripts name: Llama2Tokenizer and
GPTSentencePieceTokenizer (a SentencePiece tokenizer.model) and NullTokenizer (pre-tokenized
data, --vocab-size)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dtmega.data.indexed import IndexedDataset
from dtmega.data.tokenizers import (
    NullTokenizer,
    SentencePieceTokenizer,
    TokenizerSpec,
    build_tokenizer,
    tokenizer_from_json,
)
from dtmega.kernels.errors import DtmegaError
from dtmega.train.args import ArgumentError
from dtmega.train.trainer import train
from tests.corpus import make_texts
from tests.train_helpers import prepare_corpus, tiny_args


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    import sentencepiece

    root = tmp_path_factory.mktemp("spm")
    (root / "text.txt").write_text("\n".join(make_texts(80, seed=4)))
    sentencepiece.SentencePieceTrainer.train(input=str(root / "text.txt"), model_prefix=str(root / "tokenizer"),
                                             vocab_size=200, model_type="bpe", minloglevel=2)
    return root / "tokenizer.model"


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "GPTSentencePieceTokenizer"])
def test_megatrons_sentencepiece_types_read_the_tokenizer_model(kind, sentencepiece_model):
    tokenizer = build_tokenizer(TokenizerSpec(kind, str(sentencepiece_model)))
    reference = SentencePieceTokenizer(sentencepiece_model.read_bytes())
    text = make_texts(3, seed=9)[0]
    assert tokenizer.encode(text) == reference.encode(text)
    assert (tokenizer.vocab_size, tokenizer.eod) == (reference.vocab_size, reference.eod)
    with pytest.raises(DtmegaError, match=f"--tokenizer-type {kind} needs --tokenizer-model"):
        build_tokenizer(TokenizerSpec(kind))


def test_a_tokenizer_json_given_to_a_sentencepiece_type_is_refused_naming_the_right_type(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(DtmegaError, match="reads a SentencePiece tokenizer.model.*--tokenizer-type HuggingFaceTokenizer"):
        build_tokenizer(TokenizerSpec("Llama2Tokenizer", str(path)))


def test_null_tokenizer_is_megatrons():
    """Ids 0..N-1 are tokens, N is end-of-document, the vocabulary N + 1; text is ids."""
    tokenizer = build_tokenizer(TokenizerSpec("NullTokenizer", vocab_size=100))
    assert (tokenizer.vocab_size, tokenizer.eod) == (101, 100)
    assert tokenizer.encode("5 17\n99 100") == [5, 17, 99, 100]
    assert tokenizer.decode([5, 17]) == "5 17"
    again = tokenizer_from_json(tokenizer.to_json())
    assert isinstance(again, NullTokenizer) and (again.vocab_size, again.eod) == (101, 100)
    with pytest.raises(DtmegaError, match="whitespace-separated token ids"):
        tokenizer.encode("In the beginning")
    with pytest.raises(DtmegaError, match="outside 0..100"):
        tokenizer.encode("101")
    with pytest.raises(DtmegaError, match="NullTokenizer needs --vocab-size"):
        build_tokenizer(TokenizerSpec("NullTokenizer"))


def test_preprocess_with_the_null_tokenizer_stores_the_ids(tmp_path):
    from dtmega.data.preprocess_cli import main

    documents = [[3, 1, 4, 1, 5], [9, 2, 6]]
    source = tmp_path / "ids.jsonl"
    source.write_text("".join(json.dumps({"text": " ".join(map(str, d))}) + "\n" for d in documents))
    main(["--input", str(source), "--output-prefix", str(tmp_path / "ids"), "--tokenizer-type", "NullTokenizer",
          "--vocab-size", "10", "--append-eod", "--no-progress"])
    stored = IndexedDataset(str(tmp_path / "ids_text_document"))
    assert [np.asarray(stored[i]).tolist() for i in range(len(stored))] == [d + [10] for d in documents]


def test_training_on_pre_tokenized_data_with_the_null_tokenizer(tmp_path):
    """Byte-tokenized data (ids 0-255, end-of-document 256) read as NullTokenizer --vocab-size
    256: the same ids, so the same losses as with the byte tokenizer (whose vocabulary, 258,
    pads to the same 384 rows)."""
    corpus = prepare_corpus(tmp_path, documents=120)
    line = dict(train_iters=3, eval_iters=0, log_interval=1)
    as_bytes = train(tiny_args(corpus, **line)).losses
    as_ids = train(tiny_args(corpus, tokenizer_type="NullTokenizer", vocab_size=256, **line)).losses
    assert as_ids == pytest.approx(as_bytes, rel=1e-5)
    noted = train(tiny_args(corpus, vocab_size=256, **line))  # Megatron's scripts pass it with other tokenizers
    assert noted.losses == pytest.approx(as_bytes, rel=1e-5)


def test_mock_data_trains_without_data_files_with_the_null_tokenizer(tmp_path):
    """Megatron's FP8 example without data: --mock-data --tokenizer-type NullTokenizer
    --vocab-size N. Samples are the run's shape, the same for every run with the same seed, and
    never the end-of-document id; nothing to learn, so the loss stays near ln(N)."""
    import math

    from dtmega.data.mock import MockDataset

    line = dict(data_path=None, mock_data=True, tokenizer_type="NullTokenizer", vocab_size=300, train_iters=3,
                eval_iters=1, eval_interval=3, log_interval=1)
    first = train(tiny_args("unused", **line))
    again = train(tiny_args("unused", **line))
    assert first.losses == pytest.approx(again.losses, rel=1e-6) and len(first.losses) == 3
    assert abs(first.losses[0] - math.log(301)) < 0.5
    sample = MockDataset("train", 4, 32, 301, 300, 1)[2]
    assert sample.shape == (33,) and sample.max() < 301 and 300 not in sample.tolist()
    with pytest.raises(ArgumentError, match="--data-path and --mock-data both say where the samples come from"):
        train(tiny_args(str(tmp_path / "x"), mock_data=True, tokenizer_type="NullTokenizer", vocab_size=300))
