"""One vocabulary rule for every command that reads tokenized data (train, evaluate).

Data ids are checked against the *tokenizer's* vocabulary, never the model's padded table: ids
in the padding (a byte-tokenizer model padded to 384 rows, fed data from a 352-token BPE) would
embed, train and evaluate silently on another tokenizer's data. The largest id comes from the
`.stats.json` sidecar `dtmega preprocess` writes; data without one (made by Megatron's
preprocess, or copied without it) is scanned once, in 64 Mi-token chunks of its memory map
(about a second per GB), and the result cached beside the data under the data's identity (the
same key as the sample index: another corpus written into the prefix is scanned again).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from dtmega.data.indexed import IndexedDataset, read_stats
from dtmega.kernels.errors import DtmegaError
from dtmega.safe_files import read_regular_json, write_file_exclusive

_CHUNK = 64 << 20


class DataVocabularyError(DtmegaError):
    """Tokenized data holds ids its tokenizer does not have."""


def _cache_file(data: IndexedDataset) -> Path:
    return Path(f"{data.prefix}.dtmega-index") / f"max-token-id-{data.identity}.json"


def _scan(data: IndexedDataset) -> int:
    tokens = np.memmap(Path(f"{data.prefix}.bin"), dtype=data.dtype, mode="r")
    highest = -1
    for start in range(0, len(tokens), _CHUNK):
        highest = max(highest, int(tokens[start:start + _CHUNK].max()))
    return highest


def max_token_id(prefix: str | Path) -> tuple[int, float | None]:
    """(the largest token id in the data at `prefix`, its unigram entropy in nats if recorded)."""
    stats = read_stats(prefix)
    if stats is not None:
        return int(stats["max_token_id"]), stats.get("unigram_entropy_nats")
    data = IndexedDataset(prefix)
    cache = _cache_file(data)
    try:
        return int(read_regular_json(cache, "the data's token-id cache")["max_token_id"]), None
    except (OSError, ValueError, KeyError, TypeError):
        pass
    highest = _scan(data) if data.num_tokens else -1
    try:  # a read-only data directory just means scanning again next time
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        write_file_exclusive(tmp, json.dumps({"max_token_id": highest}))
        os.replace(tmp, cache)
    except OSError:
        pass
    return highest, None


def check_data_ids(prefix: str | Path, tokenizer_vocab: int, command: str = "this run") -> float | None:
    """Refuses data at `prefix` holding an id the tokenizer (of `tokenizer_vocab` ids) lacks;
    returns the data's unigram entropy when preprocessing recorded it."""
    highest, entropy = max_token_id(prefix)
    if highest >= tokenizer_vocab:
        raise DataVocabularyError(
            f"{prefix} holds token id {highest}, but {command}'s tokenizer has {tokenizer_vocab} ids: the data was "
            "tokenized with another, larger vocabulary. Fix: pass the tokenizer the data was preprocessed with "
            "(--tokenizer-type/--tokenizer-model), or preprocess it again with this one")
    return entropy
