"""`dtmega preprocess`: JSONL in, Megatron-format `<prefix>_<key>_document.bin/.idx` out.

The input is streamed in batches of lines, so memory stays bounded whatever the input size;
worker processes tokenize a batch while nothing else is held. Outputs are written to temporary
files and renamed into place at the end: a failed run leaves no file that looks valid.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
from rich.console import Console

from dtmega.data.indexed import IndexedDatasetWriter, token_dtype
from dtmega.data.tokenizers import TokenizerSpec, TokenizerTextError, build_tokenizer, train_bpe
from dtmega.kernels.errors import DtmegaError, MissingInput
from dtmega.progress import progress_bar
from dtmega.writable import make_writable_dir

LINES_PER_TASK = 512


class InputError(DtmegaError):
    """The input cannot be preprocessed; the message names the line and the fix."""


@dataclass
class PreprocessConfig:
    """What to read, how to tokenize, where to write (Megatron's preprocess_data.py flags)."""

    input: Path
    output_prefix: str
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)
    append_eod: bool = False
    workers: int = 1
    train_tokenizer: int | None = None
    skip_bad_lines: bool = False
    progress: bool = True


@dataclass
class PreprocessResult:
    """What a run produced and how fast."""

    outputs: dict[str, str]
    documents: int
    tokens: int
    skipped_lines: int
    input_bytes: int
    seconds: float
    tokenizer_path: str | None = None

    @property
    def mb_per_second(self) -> float:
        return self.input_bytes / 1e6 / max(self.seconds, 1e-9)


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's naming: `<output-prefix>_<json-key>_document`."""
    return f"{output_prefix}_{key}_document"


def _json_kind(value) -> str:
    for kind, name in ((bool, "a boolean"), ((int, float), "a number"), (list, "a list"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null"


def parse_line(line_number: int, raw: bytes, keys: list[str]) -> dict[str, str]:
    """The texts of one JSONL line; InputError naming the line if it is not usable."""
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as error:
        raise InputError(f"line {line_number}: not valid JSON ({error.msg} at column {error.colno})") from None
    except UnicodeDecodeError:
        raise InputError(f"line {line_number}: not UTF-8 text") from None
    if not isinstance(record, dict):
        raise InputError(f"line {line_number}: expected a JSON object, got {type(record).__name__}")
    missing = [key for key in keys if key not in record]
    if missing:
        raise InputError(f"line {line_number}: no key {missing[0]!r} (the line has {sorted(record)}); "
                         "choose keys with --json-keys")
    texts = {}
    for key in keys:
        if not isinstance(record[key], str):
            raise InputError(f"line {line_number}: {key!r} holds {_json_kind(record[key])}, not a string")
        try:  # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer can encode
            record[key].encode("utf-8")
        except UnicodeEncodeError as error:
            raise InputError(f"line {line_number}: {key!r} holds a lone surrogate {record[key][error.start]!r} at "
                             f"character {error.start} (a \\u escape of half a UTF-16 pair), not text") from None
        texts[key] = record[key]
    return texts


def read_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) for every non-blank line, streamed."""
    with open(path, "rb") as stream:
        for number, raw in enumerate(stream, start=1):
            if raw.strip():
                yield number, raw


def _batches(lines: Iterator[tuple[int, bytes]], size: int) -> Iterator[list[tuple[int, bytes]]]:
    batch = []
    for item in lines:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# ---- worker side ------------------------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(spec: TokenizerSpec, keys: list[str], append_eod: bool) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = build_tokenizer(spec)
    _WORKER.update(tokenizer=tokenizer, keys=keys, append_eod=append_eod, dtype=token_dtype(tokenizer.vocab_size))


def _encode_lines(lines: list[tuple[int, bytes]]) -> list[tuple[int, int, dict[str, np.ndarray] | str]]:
    tokenizer, keys, dtype = _WORKER["tokenizer"], _WORKER["keys"], _WORKER["dtype"]
    out = []
    for number, raw in lines:
        try:
            texts = parse_line(number, raw, keys)
        except InputError as error:
            out.append((number, len(raw), str(error)))
            continue
        encoded = {}
        try:
            for key, text in texts.items():
                if hasattr(tokenizer, "encode_array"):
                    ids = tokenizer.encode_array(text).astype(dtype, copy=False)
                else:
                    ids = np.asarray(tokenizer.encode(text), dtype=dtype)
                if len(ids) and _WORKER["append_eod"]:
                    ids = np.append(ids, np.asarray([tokenizer.eod], dtype=dtype))
                encoded[key] = ids
        except TokenizerTextError as error:  # a bad line like any other: named, skippable
            out.append((number, len(raw), f"line {number}: {key!r}: {error}"))
            continue
        out.append((number, len(raw), encoded))
    return out


# ---- driver -----------------------------------------------------------------------------------
def _texts_for_training(config: PreprocessConfig, skipped: list[int]) -> Iterator[str]:
    for number, raw in read_lines(config.input):
        try:
            yield from parse_line(number, raw, config.json_keys).values()
        except InputError:
            if not config.skip_bad_lines:
                raise
            skipped.append(number)


def preprocess(config: PreprocessConfig, console: Console | None = None) -> PreprocessResult:
    """Tokenizes `config.input` into one indexed dataset per JSON key."""
    console = console or Console(stderr=True)
    if not config.input.is_file():
        raise MissingInput(f"--input {config.input} is not a file (a JSONL file is expected)")
    if config.workers < 1:
        raise DtmegaError(f"--workers must be >= 1, got {config.workers}")
    try:  # before hours of tokenizing, not at the first write
        make_writable_dir(Path(config.output_prefix).parent)
    except OSError as error:
        raise InputError(f"--output-prefix {config.output_prefix}: cannot write there ({error.strerror}: "
                         f"{error.filename}). Fix: an output prefix in a writable directory") from None
    start = time.perf_counter()
    spec, tokenizer_path = config.tokenizer, None
    if config.train_tokenizer:
        tokenizer_path = Path(config.output_prefix).parent / "tokenizer.json"
        with progress_bar(f"training a {config.train_tokenizer}-token byte-level BPE on {config.input}",
                          console=console if config.progress else Console(quiet=True)):
            train_bpe(_texts_for_training(config, []), config.train_tokenizer, tokenizer_path)
        spec = TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=str(tokenizer_path))
    tokenizer = build_tokenizer(spec)
    dtype = token_dtype(tokenizer.vocab_size)
    outputs = {key: output_prefix_for(config.output_prefix, key) for key in config.json_keys}
    writers = {key: IndexedDatasetWriter(prefix, dtype) for key, prefix in outputs.items()}
    skipped: list[int] = []
    documents = 0
    total_bytes = config.input.stat().st_size
    pool = None
    try:
        if config.workers > 1:
            pool = multiprocessing.get_context("spawn").Pool(
                config.workers, initializer=_init_worker, initargs=(spec, config.json_keys, config.append_eod)
            )
        else:
            _init_worker(spec, config.json_keys, config.append_eod)
        with progress_bar(f"tokenizing {config.input}", total=total_bytes, in_bytes=True,
                          console=console if config.progress else Console(quiet=True)) as progress:
            for batch in _batches(read_lines(config.input), LINES_PER_TASK * config.workers):
                tasks = [batch[i:i + LINES_PER_TASK] for i in range(0, len(batch), LINES_PER_TASK)]
                results = pool.map(_encode_lines, tasks) if pool else [_encode_lines(t) for t in tasks]
                for number, size, encoded in (item for result in results for item in result):
                    progress.advance(size)
                    if isinstance(encoded, str):
                        if not config.skip_bad_lines:
                            raise InputError(f"{config.input}: {encoded}. Fix the line, or pass --skip-bad-lines to "
                                             "skip and count such lines")
                        skipped.append(number)
                        continue
                    for key, ids in encoded.items():
                        writers[key].add_document([ids] if len(ids) else [])
                    documents += 1
        if documents == 0:
            raise InputError(
                f"{config.input} holds no documents"
                + (f" ({len(skipped)} bad lines skipped)" if skipped else "")
                + ". Fix: point --input at a JSONL file with one JSON object per line"
            )
        for writer in writers.values():
            writer.finalize()
    except BaseException as error:
        for writer in writers.values():
            writer.abort()
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):  # matrix 3, D12
            raise InputError(f"--output-prefix {config.output_prefix}: {error.strerror} while writing the tokens; "
                             "the temporary files were removed and nothing else was touched. Fix: free space there, "
                             "or another --output-prefix") from None
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return PreprocessResult(
        outputs=outputs, documents=documents, tokens=sum(w.tokens for w in writers.values()),
        skipped_lines=len(skipped), input_bytes=total_bytes, seconds=time.perf_counter() - start,
        tokenizer_path=str(tokenizer_path) if tokenizer_path else None,
    )
