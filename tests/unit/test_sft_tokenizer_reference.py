"""The packed chat header names its tokenizer instead of embedding it (issue 47, item 10:
`data/chat_sft.json` held SmolLM2's whole 2.1 MB tokenizer.json for 28 KB of samples): the file's
path and sha256. `sft_tokenizer` reads it back (the same ids), refuses a tokenizer file that
changed or is gone naming it, and still reads a header written before, which embeds the JSON."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from dtmega.data.sft_dataset import read_header, sft_tokenizer
from dtmega.data.tokenizers import TokenizerSpec, build_tokenizer
from dtmega.kernels.errors import DtmegaError, MissingInput
from tests.smollm2 import smollm2_dir
from tests.unit.test_sft import conversations

TEXT = "What is 7 plus 7? 7 plus 7 is 14."


@pytest.fixture
def made(tmp_path):
    """(packed chat prefix, the tokenizer directory it was made with: a copy of SmolLM2's)."""
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (smollm2_dir() / name).exists():
            shutil.copy(smollm2_dir() / name, tokenizer_dir / name)
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in conversations(6)))
    prefix = str(tmp_path / "data" / "chat")
    from dtmega.cli import main

    assert main(["preprocess", "--chat", "--input", str(source), "--output-prefix", prefix, "--tokenizer-type",
                 "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer_dir), "--seq-length", "96"]) == 0
    return prefix, tokenizer_dir


def test_the_header_holds_a_reference_and_the_tokenizer_reads_back(made):
    prefix, tokenizer_dir = made
    text = open(f"{prefix}_sft.json").read()
    assert len(text) < 20_000, len(text)  # the tokenizer alone is 2.1 MB
    reference = read_header(prefix)["tokenizer"]
    file = tokenizer_dir / "tokenizer.json"
    assert reference["path"] == str(file.resolve())
    assert reference["sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    original = build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(tokenizer_dir)))
    again = sft_tokenizer(prefix)
    assert again.encode(TEXT) == original.encode(TEXT) and again.eod == original.eod == read_header(prefix)["eod"]


def test_a_changed_or_missing_tokenizer_is_refused_naming_it(made):
    prefix, tokenizer_dir = made
    file = tokenizer_dir / "tokenizer.json"
    file.write_text(file.read_text() + "\n")
    with pytest.raises(DtmegaError, match=rf"{file.resolve()} is not the tokenizer .*chat_sft.json was made with.*Fix:"):
        sft_tokenizer(prefix)
    file.unlink()
    with pytest.raises(MissingInput, match=rf"chat_sft.json was made with the tokenizer {file.resolve()}, which no longer"):
        sft_tokenizer(prefix)


def test_a_header_written_before_references_still_reads(made):
    prefix, tokenizer_dir = made
    original = build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(tokenizer_dir)))
    header = read_header(prefix)
    header["tokenizer"] = original.to_json()  # how headers were written before: the tokenizer itself
    with open(f"{prefix}_sft.json", "w") as out:
        json.dump(header, out)
    assert sft_tokenizer(prefix).encode(TEXT) == original.encode(TEXT)


@pytest.mark.parametrize("damage, message", [
    # matrix-3 D5: loss flags 7 and -3 trained a validation loss of -2502.92, exit 0
    (lambda d: d[:, 1].__setitem__(slice(None), np.where(d[:, 1] == 1, 7, -3)), r"holds the loss flag (7|-3) in sample 0"),
    # matrix-3 D4: conversation ids that fall inside a sample (another layout with the same byte count)
    (lambda d: d[0, 2].__setitem__(slice(None), d[0, 2][::-1].copy()), r"sample 0's conversation ids do not rise from 0"),
    (lambda d: d[0, 0].__setitem__(3, -5), r"holds the negative token id -5"),
])
def test_damaged_packed_chat_samples_are_refused_at_start_up(made, damage, message):
    """`check_sft_file` (run before any process group) reads every sample's flags, ids and
    conversation ids, naming the file and "preprocess again"."""
    from dtmega.data.sft_dataset import check_sft_file

    prefix, _ = made
    header = read_header(prefix)
    path = f"{prefix}_sft.bin"
    data = np.fromfile(path, dtype=np.int32).reshape(header["samples"], 3, header["seq_length"] + 1)
    check_sft_file(prefix, header["seq_length"], 1 << 20)  # the intact file passes
    damage(data)
    data.tofile(path)
    with pytest.raises(DtmegaError, match=message):
        check_sft_file(prefix, header["seq_length"], 1 << 20)
