"""`dtmega preprocess`: tokenizers, keys, workers, and every bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dtmega.data.indexed import IndexedDataset, read_stats
from dtmega.data.preprocess import InputError, PreprocessConfig, preprocess
from dtmega.data.tokenizers import ByteTokenizer, TokenizerSpec, build_tokenizer, train_bpe
from tests.corpus import make_texts, write_jsonl


def run(tmp_path: Path, source: Path, **options):
    config = PreprocessConfig(input=source, output_prefix=str(tmp_path / "out" / "corpus"), progress=False, **options)
    return preprocess(config)


def test_byte_tokenizer_with_eod_and_two_keys(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", ["héllo", "", "ab"], extra={"title": "T"})
    result = run(tmp_path, source, json_keys=["text", "title"], append_eod=True)
    text = IndexedDataset(result.outputs["text"])
    assert result.outputs["text"].endswith("corpus_text_document")
    assert text.num_documents == 3 and len(text) == 2  # the empty document has no sequence
    assert list(text[0]) == list("héllo".encode()) + [ByteTokenizer.eod]
    assert list(IndexedDataset(result.outputs["title"])[2]) == [ord("T"), ByteTokenizer.eod]
    stats = read_stats(result.outputs["text"])
    assert stats["tokens"] == text.num_tokens and stats["max_token_id"] == ByteTokenizer.eod


def test_workers_give_identical_files(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", make_texts(3000, seed=1))
    one = run(tmp_path / "a", source, workers=1)
    two = run(tmp_path / "b", source, workers=2)
    for suffix in (".bin", ".idx"):
        assert Path(one.outputs["text"] + suffix).read_bytes() == Path(two.outputs["text"] + suffix).read_bytes()


def test_trained_bpe_round_trips_and_is_saved_beside_the_output(tmp_path):
    texts = make_texts(400, seed=2)
    source = write_jsonl(tmp_path / "in.jsonl", texts)
    result = run(tmp_path, source, train_tokenizer=300, append_eod=True)
    assert Path(result.tokenizer_path) == tmp_path / "out" / "tokenizer.json"
    tokenizer = build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=result.tokenizer_path))
    assert tokenizer.vocab_size == 300
    data = IndexedDataset(result.outputs["text"])
    assert data.dtype == np.uint16
    assert tokenizer.decode(list(data[5])) == texts[5] + "<|endoftext|>"


def test_gpt2_bpe_from_vocab_and_merges(tmp_path):
    model_dir = tmp_path / "gpt2"
    model_dir.mkdir()
    trained = train_bpe(make_texts(200), 300, tmp_path / "tok.json")
    trained.model.model.save(str(model_dir))
    spec = TokenizerSpec("GPT2BPETokenizer", vocab_file=str(model_dir / "vocab.json"), merge_file=str(model_dir / "merges.txt"))
    gpt2 = build_tokenizer(spec)
    assert gpt2.encode("the lord said") == trained.encode("the lord said") and gpt2.eod == trained.eod
    source = write_jsonl(tmp_path / "in.jsonl", ["the lord said"])
    assert run(tmp_path, source, tokenizer=spec).tokens == len(gpt2.encode("the lord said"))


def test_huggingface_tokenizer_needs_an_eod_token(tmp_path):
    trained = train_bpe(make_texts(50), 280, tmp_path / "tok.json")
    assert build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(tmp_path / "tok.json"))).eod == trained.eod
    with pytest.raises(ValueError, match="no end-of-document token.*--eod-token"):
        build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(tmp_path / "tok.json"), eod_token="<eos>"))
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(tmp_path / "missing.json")))


def test_malformed_line_names_the_line_and_skipping_counts(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "a"}\n{"text": "b"\n\n{"text": "c"}\n[1, 2]\n')
    with pytest.raises(InputError, match=r"line 2: not valid JSON.*--skip-bad-lines"):
        run(tmp_path, source)
    assert not (tmp_path / "out" / "corpus_text_document.bin").exists()
    result = run(tmp_path, source, skip_bad_lines=True)
    assert result.skipped_lines == 2 and result.documents == 2


def test_a_lone_surrogate_is_a_bad_line_that_can_be_skipped(tmp_path):
    """JSON may escape half a UTF-16 pair (\\ud800): valid JSON, but no text a tokenizer can
    encode. Before: a raw UnicodeEncodeError that --skip-bad-lines did not skip."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "a"}\n{"text": "x\\ud800y"}\n{"text": "c"}\n')
    with pytest.raises(InputError, match=r"line 2: 'text' holds a lone surrogate '\\ud800' at character 1.*"
                                         r"--skip-bad-lines"):
        run(tmp_path, source)
    result = run(tmp_path, source, skip_bad_lines=True)
    assert result.skipped_lines == 1 and result.documents == 2


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_an_unwritable_output_is_refused_before_tokenizing(tmp_path, where):
    """Before: a raw NotADirectoryError / FileNotFoundError traceback."""
    source = write_jsonl(tmp_path / "in.jsonl", ["abc", "def"])
    if where == "under_a_file":
        (tmp_path / "a_file").write_text("x")
        prefix = tmp_path / "a_file" / "corpus"
    else:
        prefix = Path("/proc/dtmega-test/corpus")
    with pytest.raises(InputError, match=r"--output-prefix .*corpus: cannot write there \(.*\)\. Fix: an output prefix "
                                         r"in a writable directory"):
        preprocess(PreprocessConfig(input=source, output_prefix=str(prefix), progress=False))


def test_missing_key(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", ["a"], key="body")
    with pytest.raises(InputError, match=r"line 1: no key 'text' \(the line has \['body', 'id'\]\)"):
        run(tmp_path, source)


def test_empty_input(tmp_path):
    (tmp_path / "in.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match="holds no documents"):
        run(tmp_path, tmp_path / "in.jsonl")
    with pytest.raises(FileNotFoundError, match="is not a file"):
        run(tmp_path, tmp_path / "missing.jsonl")


def test_failed_run_never_half_overwrites_earlier_output(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", ["abc", "def"])
    first = run(tmp_path, good)
    before = {s: Path(first.outputs["text"] + s).read_bytes() for s in (".bin", ".idx")}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "new"}\n' * 500 + "not json\n")
    with pytest.raises(InputError):
        run(tmp_path, bad)
    assert {s: Path(first.outputs["text"] + s).read_bytes() for s in (".bin", ".idx")} == before
    assert not [p for p in (tmp_path / "out").iterdir() if p.suffix == ".tmp"]


def test_an_interrupted_run_never_half_overwrites_earlier_output(tmp_path, monkeypatch):
    """docs/reliability.md, Data: an "interrupted preprocess" leaves the earlier output as it was.
    Ctrl-C (KeyboardInterrupt) arrives at the 300th document of a second run into the same
    prefix, while its temporaries hold part of the new tokens: the interrupt propagates, the
    earlier `.bin`, `.idx` and `.stats.json` are byte-identical, and no `.tmp` file is left."""
    from dtmega.data.indexed import IndexedDatasetWriter

    first = run(tmp_path, write_jsonl(tmp_path / "good.jsonl", ["abc", "def"]))
    names = [first.outputs["text"] + suffix for suffix in (".bin", ".idx", ".stats.json")]
    before = {name: Path(name).read_bytes() for name in names}
    real_add, added, temporaries = IndexedDatasetWriter.add_document, [], []

    def interrupted(self, sequences):
        added.append(1)
        if len(added) == 300:
            temporaries.extend(p.name for p in (tmp_path / "out").iterdir() if p.suffix == ".tmp")
            raise KeyboardInterrupt
        return real_add(self, sequences)

    monkeypatch.setattr(IndexedDatasetWriter, "add_document", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, write_jsonl(tmp_path / "new.jsonl", ["new text"] * 1000))
    assert temporaries, "the interrupt came before the run wrote anything"
    assert {name: Path(name).read_bytes() for name in names} == before
    assert not [p for p in (tmp_path / "out").iterdir() if p.suffix == ".tmp"]


def test_cli_reports_errors_with_exit_status_2(tmp_path):
    import subprocess
    import sys

    source = tmp_path / "in.jsonl"
    source.write_text('{"text": 1}\n')
    out = subprocess.run([sys.executable, "-m", "dtmega", "preprocess", "--input", str(source), "--output-prefix",
                          str(tmp_path / "o"), "--tokenizer-type", "byte", "--no-progress"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "line 1: 'text' holds a number, not a string" in out.stderr
    ok = subprocess.run([sys.executable, "-m", "dtmega", "preprocess", "--input", str(write_jsonl(tmp_path / "g.jsonl", ["x"])),
                         "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "byte", "--no-progress"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "o_text_document.stats.json").read_text())["documents"] == 1


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("style", ["gpt2_byte_level", "llama3_split_then_byte_level", "byte_level_without_regex"])
def test_a_long_document_is_encoded_in_pieces_with_the_same_ids(tmp_path, style):
    """N41 of the second fault matrix: one 50 MB line peaked at 9.1 GB in `tokenizers`. Texts
    over HuggingFaceTokenizer.LONG_TEXT characters are cut at a single space between non-spaces,
    a boundary of every whitespace-splitting pre-tokenizer: the ids equal the whole text's. A
    pre-tokenizer that does not split there (byte-level without its regex) is never cut."""
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizerModel

    from dtmega.data.tokenizers import HuggingFaceTokenizer, train_bpe
    from tests.corpus import make_texts

    train_bpe(make_texts(60, seed=5), 300, tmp_path / "tokenizer.json")
    model = HFTokenizerModel.from_file(str(tmp_path / "tokenizer.json"))
    if style == "llama3_split_then_byte_level":
        model.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif style == "byte_level_without_regex":
        model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer = HuggingFaceTokenizer(model)
    assert tokenizer.splits_at_spaces == (style != "byte_level_without_regex")
    text = " ".join(make_texts(300, seed=9)) + "  two  spaces\n\nlines\tand tabs 123 4567 !!?? it's 'quoted' end"
    whole = model.encode(text, add_special_tokens=False).ids
    pieces = []
    real_encode = model.encode
    tokenizer.model = type("Spy", (), {"encode": lambda self, t, **k: pieces.append(len(t)) or real_encode(t, **k)})()
    tokenizer.LONG_TEXT = 997
    assert tokenizer.encode(text) == whole
    assert (max(pieces) < 2 * 997 and len(pieces) > 10) if tokenizer.splits_at_spaces else pieces == [len(text)]


# ---- the preprocessing cases of the second fault matrix (../shared/reliability/matrix-2.md) ----

def test_a_zero_byte_input_holds_no_documents(tmp_path):
    """N39."""
    (tmp_path / "in.jsonl").write_bytes(b"")
    with pytest.raises(InputError, match="holds no documents"):
        run(tmp_path, tmp_path / "in.jsonl")


def test_one_very_long_line_with_the_byte_tokenizer(tmp_path):
    """N40 (4 MB here; 50 MB took 4 s in the matrix): one document, every byte a token."""
    text = "word " * 800_000
    result = run(tmp_path, write_jsonl(tmp_path / "in.jsonl", [text]), append_eod=True)
    assert result.documents == 1 and IndexedDataset(result.outputs["text"]).num_tokens == len(text) + 1


@pytest.mark.parametrize("raw, line", [
    (b'{"text": "a"}\n{"text": "caf\xe9"}\n{"text": "c"}\n', 2),  # N42: a latin-1 line between UTF-8 lines
    ('{"text": "a"}\n{"text": "b"}\n'.encode("utf-16"), 1),  # N43: a UTF-16 file
])
def test_text_that_is_not_utf8_names_its_line(tmp_path, raw, line):
    (tmp_path / "in.jsonl").write_bytes(raw)
    with pytest.raises(InputError, match=rf"line {line}: not UTF-8 text.*--skip-bad-lines"):
        run(tmp_path, tmp_path / "in.jsonl")
    if line == 2:
        assert run(tmp_path, tmp_path / "in.jsonl", skip_bad_lines=True).skipped_lines == 1


def test_a_utf8_byte_order_mark_is_not_tokenized(tmp_path):
    """N44."""
    (tmp_path / "in.jsonl").write_bytes('\ufeff{"text": "ab"}\n{"text": "cd"}\n'.encode("utf-8"))
    result = run(tmp_path, tmp_path / "in.jsonl")
    data = IndexedDataset(result.outputs["text"])
    assert result.documents == 2 and [list(data[i]) for i in range(2)] == [list(b"ab"), list(b"cd")]
