"""Megatron's TikTokenizer (issue 47, item 5): the ids of `--tokenizer-type TikTokenizer` equal
megatron-core's own TikTokenTokenizer (the reference) for both patterns, default and custom special
tokens; a checkpoint's copy and the Hugging Face export give the same ids; bad vocabularies and
settings are one line naming the fix. The vocabulary is a byte-level BPE trained here, written in
the tiktoken JSON format (rank, token_bytes, token_str)."""

from __future__ import annotations

import base64
import json

import pytest

from dtmega.data.byte_level import byte_symbols
from dtmega.data.tiktoken_tokenizer import TikTokenizer, TikTokenSettings
from dtmega.data.tokenizers import TokenizerSpec, build_tokenizer, tokenizer_from_json
from dtmega.kernels.errors import DtmegaError
from tests.corpus import make_texts

TEXTS = ["The lord said unto Moses, go forth into the land.", "  spaces   and\ttabs\n\nnew lines 12345 67",
         "Ünïcödé — «quotes» and emoji 🙂 mixed with ASCII", "special </s> and <s> inside text", "CamelCaseWords ALLCAPS x"]


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory):
    """A tiktoken vocabulary: the 256 bytes, then a trained BPE's merges in order (rank = order)."""
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("tiktoken")
    (root / "text.txt").write_text("\n".join(make_texts(400, seed=9) + TEXTS))
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(root / "text.txt")], vocab_size=700, show_progress=False)
    merges = json.loads(bpe.to_str())["model"]["merges"]
    to_byte = {symbol: byte for byte, symbol in byte_symbols().items()}
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    for merge in merges:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        token = bytes(to_byte[c] for c in left + right)
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    path = root / "vocab.json"
    path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                                 "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(tokens)]))
    return path, len(tokens)


def _reference(path, pattern: str, vocab: int, special: int, tokens=None):
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer

    return TikTokenTokenizer(str(path), special_tokens=list(tokens) if tokens else None, num_special_tokens=special,
                             pattern=pattern, vocab_size=vocab)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
@pytest.mark.parametrize("special", [None, ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<|im_end|>")])
def test_ids_equal_megatron_cores_tiktokenizer(vocabulary, pattern, special):
    path, ranks = vocabulary
    vocab, count = 300 + 16, 16  # the vocabulary cut to 300 ranks after 16 special ids, as --vocab-size cuts it
    ours = build_tokenizer(TokenizerSpec("TikTokenizer", str(path), vocab_size=vocab, tiktoken_pattern=pattern,
                                         tiktoken_num_special_tokens=count, tiktoken_special_tokens=special))
    theirs = _reference(path, pattern, vocab, count, special)
    assert ours.vocab_size == theirs.vocab_size == vocab and ours.eod == theirs.eod == 2
    for text in TEXTS + make_texts(20, seed=1):
        ids = ours.encode(text)
        assert ids == theirs.text_to_ids(text), text
        assert max(ids) < vocab
        assert ours.decode(ids) == text
    if special:
        assert ours.encode("<|im_end|>") == [7]


def test_a_checkpoints_copy_and_the_hugging_face_export_give_the_same_ids(vocabulary):
    path, _ = vocabulary
    ours = TikTokenizer.from_file(path, TikTokenSettings("v2", 10, None, 310))
    again = tokenizer_from_json(ours.to_json())
    hf = ours.as_huggingface()
    for text in TEXTS + make_texts(30, seed=2):
        assert again.encode(text) == ours.encode(text)
        assert hf.encode(text, add_special_tokens=False).ids == ours.encode(text), text
    assert hf.decode(ours.encode(TEXTS[2]), skip_special_tokens=False) == TEXTS[2]


@pytest.mark.parametrize("settings, entries, message", [
    (TikTokenSettings("v2", 10, None, 5000), None, "holds"),  # fewer ranks than --vocab-size asks for
    (TikTokenSettings("v3", 10, None, 310), None, "--tiktoken-pattern 'v3'"),
    (TikTokenSettings("v2", 10, ("<s>", "</s>"), 310), None, "must be distinct and include"),
    (TikTokenSettings("v2", 3, None, 310), None, "--tiktoken-num-special-tokens 3"),
    (TikTokenSettings("v2", 10, None, 300), [{"rank": 0, "token_bytes": "AQ==", "token_str": "x"}], "entry 0"),
])
def test_bad_settings_and_vocabularies_are_one_line_with_the_fix(vocabulary, tmp_path, settings, entries, message):
    path, _ = vocabulary
    if entries is not None:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(entries * 300))
    with pytest.raises(DtmegaError, match="Fix") as error:
        TikTokenizer.from_file(path, settings)
    assert message in str(error.value)


def test_preprocess_and_train_read_the_same_ids(vocabulary, tmp_path):
    """`dtmega preprocess --tokenizer-type TikTokenizer` writes the ids the tokenizer gives, and a
    one-rank `dtmega train` with the same flags trains on them."""
    from dtmega.cli import main
    from dtmega.data.indexed import IndexedDataset
    from dtmega.train.trainer import train
    from tests.corpus import write_jsonl
    from tests.train_helpers import tiny_args

    path, _ = vocabulary
    texts = make_texts(80, seed=4)
    write_jsonl(tmp_path / "corpus.jsonl", texts)
    flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(path), "--vocab-size", "310",
             "--tiktoken-num-special-tokens", "10", "--tiktoken-pattern", "v2"]
    assert main(["preprocess", "--input", str(tmp_path / "corpus.jsonl"), "--output-prefix", str(tmp_path / "c"),
                 "--append-eod", "--no-progress", *flags]) == 0
    data = IndexedDataset(tmp_path / "c_text_document")
    tokenizer = TikTokenizer.from_file(path, TikTokenSettings("v2", 10, None, 310))
    assert list(data.get(3)) == tokenizer.encode(texts[3]) + [tokenizer.eod]
    line = tiny_args(str(tmp_path / "c_text_document"), tokenizer_type="TikTokenizer", tokenizer_model=str(path),
                     vocab_size=310, tiktoken_num_special_tokens=10, train_iters=2, eval_iters=0)
    result = train(line)
    assert len(result.losses) == 2 and all(loss == loss for loss in result.losses)
