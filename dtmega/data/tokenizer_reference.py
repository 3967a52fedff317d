"""A tokenizer named by a data file's header instead of copied into it: its file's path and the
sha256 of its bytes (`dtmega preprocess --chat` wrote SmolLM2's whole 2.1 MB tokenizer.json into
a header of 28 KB of samples). Reading it back checks the bytes, so a file that changed since is
refused naming it, never silently used; headers written before embed the tokenizer's JSON text,
which still reads.

    reference = tokenizer_reference("HF_DIR", tokenizer)   # {"path": ".../tokenizer.json", "sha256": ..., ...}
    tokenizer = tokenizer_from_reference(reference, "data/chat_sft.json")
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from dtmega.data.tokenizers import Tokenizer, tokenizer_from_json, tokenizer_from_path
from dtmega.kernels.errors import DtmegaError, MissingInput

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # what a directory is read for, in order (tokenizer_from_path)


def tokenizer_file(source: str | Path) -> Path:
    """The file a tokenizer `source` (--tokenizer-model: a file or a Hugging Face directory) is
    read from, as `tokenizer_from_path` picks it."""
    path = Path(source)
    if path.is_dir():
        found = next((path / name for name in TOKENIZER_FILES if (path / name).is_file()), None)
        if found is None:
            raise MissingInput(f"--tokenizer-model {path}: the directory holds neither tokenizer.json nor "
                               "tokenizer.model. Fix: the directory the model's tokenizer was saved to")
        return found.resolve()
    if not path.is_file():
        raise MissingInput(f"--tokenizer-model {path} does not exist")
    return path.resolve()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_reference(source: str | Path, tokenizer: Tokenizer) -> dict[str, Any]:
    """What a header keeps of the tokenizer built from `source`: the file's absolute path and
    sha256, its end-of-document token and vocabulary size (readable without the file)."""
    path = tokenizer_file(source)
    return {"path": str(path), "sha256": _sha256(path), "eod_token": getattr(tokenizer, "eod_token", None),
            "vocab_size": tokenizer.vocab_size}


def tokenizer_from_reference(reference: dict | str | None, where: str) -> Tokenizer | None:
    """The tokenizer a header (`where`, named in errors) refers to: the referenced file, its bytes
    checked against the recorded sha256 (DtmegaError naming both files when it is missing or
    changed); an older header's embedded JSON text; None when the header names none."""
    if not reference:
        return None
    if isinstance(reference, str):  # written before references: the tokenizer's JSON itself
        return tokenizer_from_json(reference)
    path = Path(reference["path"])
    if not path.is_file():
        raise MissingInput(f"{where} was made with the tokenizer {path}, which no longer exists. Fix: put the "
                           "tokenizer back there, or preprocess the data again with the tokenizer you have")
    found = _sha256(path)
    if found != reference["sha256"]:
        raise DtmegaError(f"{path} is not the tokenizer {where} was made with (sha256 {found[:12]}..., the header "
                          f"records {reference['sha256'][:12]}...): it changed since. Fix: the original tokenizer "
                          "file, or preprocess the data again with this one")
    return tokenizer_from_path(path, reference.get("eod_token"))
