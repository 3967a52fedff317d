"""Megatron-Core's indexed dataset format: tokens in `<prefix>.bin`, an index in `<prefix>.idx`.

Byte-compatible with `megatron.core.datasets.indexed_dataset`: the `.idx` file is the 9-byte
magic `MMIDIDX\\x00\\x00`, version 1 (u64), a dtype code (u8), the sequence count (u64), the
document count (u64), then int32 sequence lengths, int64 byte pointers into `.bin`, and int64
document boundaries (sequence indices, starting with 0). Data prepared by either tool reads in
the other.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from dtmega.kernels.errors import DtmegaError, MissingInput
from dtmega.safe_files import check_regular, create_exclusive, read_regular_json, replace_from_temporary

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8

# Megatron's DType codes.
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


class DatasetFormatError(DtmegaError):
    """A .bin/.idx pair is not a valid indexed dataset; the message says what and how to fix."""


def token_dtype(vocab_size: int) -> type:
    """The smallest token dtype Megatron uses for a vocabulary: uint16 below 65500, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def stats_path(prefix: str | Path) -> Path:
    """dtmega's side file with token counts and the unigram entropy (Megatron ignores it)."""
    return Path(f"{prefix}.stats.json")


def read_stats(prefix: str | Path) -> dict | None:
    """The stats `dtmega preprocess` wrote beside the data, if any."""
    path = stats_path(prefix)
    return read_regular_json(path, "the data's statistics file") if path.exists() else None


class IndexedDatasetWriter:
    """Streams documents into `<prefix>.bin/.idx`, atomically.

    Everything is written to `*.tmp` files that are renamed into place only by `finalize()`
    (index last), so an interrupted run never leaves a pair that looks valid.
    """

    def __init__(self, prefix: str | Path, dtype: type):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise DtmegaError(f"dtype {self.dtype} has no Megatron code")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = Path(f"{bin_path(prefix)}.tmp")
        self._idx_tmp = Path(f"{idx_path(prefix)}.tmp")
        self._bin = create_exclusive(self._bin_tmp)  # never written through a planted link
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self.tokens = 0
        self.token_counts = np.zeros(0, dtype=np.int64)

    def add_document(self, sequences: list[np.ndarray] | list[list[int]]) -> None:
        """Appends one document made of zero or more sequences (sentences)."""
        for sequence in sequences:
            array = np.asarray(sequence, dtype=self.dtype)
            self._bin.write(array.tobytes(order="C"))
            self.sequence_lengths.append(int(array.size))
            self.tokens += int(array.size)
            if array.size:
                counts = np.bincount(array.astype(np.int64))
                if len(counts) > len(self.token_counts):
                    self.token_counts = np.pad(self.token_counts, (0, len(counts) - len(self.token_counts)))
                self.token_counts[: len(counts)] += counts
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self) -> None:
        """Writes the index and moves both files into place."""
        self._bin.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with create_exclusive(self._idx_tmp) as index:
            index.write(INDEX_MAGIC)
            index.write(struct.pack("<Q", INDEX_VERSION))
            index.write(struct.pack("<B", CODE_OF[self.dtype]))
            index.write(struct.pack("<Q", len(lengths)))
            index.write(struct.pack("<Q", len(self.document_indices)))
            index.write(lengths.tobytes(order="C"))
            index.write(pointers.tobytes(order="C"))
            index.write(np.asarray(self.document_indices, dtype=np.int64).tobytes(order="C"))
        self._write_stats()
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))

    def _write_stats(self) -> None:
        probabilities = self.token_counts[self.token_counts > 0] / max(1, self.tokens)
        stats = {
            "documents": len(self.document_indices) - 1,
            "tokens": self.tokens,
            "max_token_id": int(len(self.token_counts) - 1),
            "unigram_entropy_nats": float(-(probabilities * np.log(probabilities)).sum()),
        }
        replace_from_temporary(stats_path(self.prefix), json.dumps(stats, indent=2))

    def abort(self) -> None:
        """Removes the temporary files (called when preprocessing fails). Closing may fail again
        the way the write failed (a full disk flushing its buffer): the files go anyway."""
        try:
            self._bin.close()
        except OSError:
            pass
        for path in (self._bin_tmp, self._idx_tmp, Path(f"{stats_path(self.prefix)}.tmp")):
            path.unlink(missing_ok=True)


_IDENTITY_BYTES = 1 << 22


def _identity(index_file: Path, data_file: Path) -> str:
    """What a sample index depends on, cheaply: both files' sizes and a hash of the index's
    first and last 4 MiB (its header, sequence lengths and document boundaries). Another corpus
    preprocessed into the same prefix changes it; a copy of the same files (other mtimes, another
    node) does not."""
    digest = hashlib.blake2b(f"{index_file.stat().st_size}:{data_file.stat().st_size}".encode(), digest_size=16)
    with open(index_file, "rb") as stream:
        digest.update(stream.read(_IDENTITY_BYTES))
        size = index_file.stat().st_size
        if size > _IDENTITY_BYTES:
            stream.seek(max(_IDENTITY_BYTES, size - _IDENTITY_BYTES))
            digest.update(stream.read())
    return digest.hexdigest()


class _FileReads:
    """`.bin` tokens read with positioned file reads instead of a memory map (Megatron's
    --no-mmap-bin-files, for file systems where mapping large files is slow or not allowed):
    slicing returns a fresh array of the tokens asked for."""

    def __init__(self, path: Path, dtype: np.dtype, tokens: int):
        self.path, self.dtype, self.tokens = path, dtype, tokens
        self._fd: int | None = None
        self._pid = -1

    def __len__(self) -> int:
        return self.tokens

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():  # a forked process opens its own
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(self.tokens)
        count = max(0, stop - start)
        raw = os.pread(self._descriptor(), count * self.dtype.itemsize, start * self.dtype.itemsize)
        if len(raw) != count * self.dtype.itemsize:
            raise DatasetFormatError(f"{self.path} ended while reading tokens {start}..{stop}: the file changed "
                                     "after it was checked. Fix: re-run `dtmega preprocess`")
        return np.frombuffer(raw, dtype=self.dtype)

    def __del__(self):
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)


_CHECK_CHUNK = 1 << 22  # sequences compared per vectorised pass: bounded temporary memory on any index


def _damaged(index_file: Path, what: str) -> DatasetFormatError:
    return DatasetFormatError(f"{index_file}: {what}: the index is damaged. Fix: re-run `dtmega preprocess`")


def check_index_arrays(index_file: Path, lengths: np.ndarray, pointers: np.ndarray, documents: np.ndarray,
                       itemsize: int, data_bytes: int) -> None:
    """Every sequence length and pointer of an index checked against each other and the data (a
    pointer that lies reads another document's tokens, a negative length a slice to the end):
    lengths >= 0, pointers[0] == 0, each pointer the previous one plus its length, the last ending
    at the data's size; document boundaries start at 0, never decrease and end at the sequence
    count. Vectorised in chunks: a few milliseconds per million sequences."""
    count = len(lengths)
    for start in range(0, count, _CHECK_CHUNK):
        stop = min(count, start + _CHECK_CHUNK)
        own = lengths[start:stop]
        if (own < 0).any():
            first = start + int(np.argmax(own < 0))
            raise _damaged(index_file, f"sequence {first} has the negative length {int(lengths[first])}")
        ends = pointers[start:stop] + own.astype(np.int64) * itemsize
        following = pointers[start + 1:stop + 1] if stop < count else np.append(pointers[start + 1:stop], data_bytes)
        wrong = ends != following
        if wrong.any():
            bad = start + int(np.argmax(wrong))
            where = f"sequence {bad + 1}'s pointer is {int(pointers[bad + 1])}" if bad + 1 < count \
                else f"the last sequence ends at byte {int(ends[-1])}, not at the data's {data_bytes}"
            raise _damaged(index_file, f"{where}, but sequence {bad} starts at {int(pointers[bad])} and holds "
                                       f"{int(lengths[bad])} tokens")
    if count and int(pointers[0]) != 0:
        raise _damaged(index_file, f"the first sequence pointer is {int(pointers[0])}, not 0")
    if len(documents) == 0 or int(documents[0]) != 0 or int(documents[-1]) != count \
            or (len(documents) > 1 and (np.diff(documents) < 0).any()):
        raise _damaged(index_file, f"its document boundaries do not run from 0 to its {count} sequences in order")


class IndexedDataset:
    """Reader of a `.bin/.idx` pair (the `.bin` memory-mapped, or read with file reads when
    `mmap` is False); validates both files before use."""

    def __init__(self, prefix: str | Path, mmap: bool = True):
        self.prefix = Path(prefix)
        index_file, data_file = idx_path(prefix), bin_path(prefix)
        for path in (index_file, data_file):
            if not path.exists():
                raise MissingInput(
                    f"{path} does not exist. Fix: pass the prefix without .bin/.idx (e.g. "
                    f"data/corpus_text_document) of files written by `dtmega preprocess`"
                )
            check_regular(path, "the indexed dataset's file")  # a FIFO or a device would block or never end
        with open(index_file, "rb") as stream:
            header = stream.read(_HEADER_BYTES)
        if len(header) < _HEADER_BYTES or header[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise DatasetFormatError(
                f"{index_file} does not start with Megatron's index magic {INDEX_MAGIC!r}: it is not "
                "an indexed-dataset index (or is corrupt). Fix: re-run `dtmega preprocess`"
            )
        version, code, sequences, documents = struct.unpack("<QBQQ", header[len(INDEX_MAGIC):])
        if version != INDEX_VERSION:
            raise DatasetFormatError(
                f"{index_file} has index version {version}; only version {INDEX_VERSION} exists. "
                "Fix: re-run `dtmega preprocess`"
            )
        if code not in DTYPE_CODES:
            raise DatasetFormatError(f"{index_file} has unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER_BYTES + sequences * (4 + 8) + documents * 8
        actual = index_file.stat().st_size
        if actual < expected:
            raise DatasetFormatError(
                f"{index_file} is truncated: {actual} bytes, but its header describes {expected}. "
                "Fix: re-run `dtmega preprocess`"
            )
        index = np.memmap(index_file, mode="r", order="C")
        offset = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(index, dtype=np.int32, count=sequences, offset=offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, dtype=np.int64, count=sequences, offset=offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index, dtype=np.int64, count=documents, offset=offset)
        data_bytes = int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        size = data_file.stat().st_size
        if size < data_bytes:
            raise DatasetFormatError(
                f"{data_file} is truncated: {size} bytes, but {index_file} "
                f"describes {data_bytes}. Fix: re-run `dtmega preprocess`"
            )
        if size != data_bytes:
            # Exact, not "at least": an index whose dtype code or lengths belong to other data
            # would otherwise read the tokens as something else.
            raise DatasetFormatError(
                f"{data_file} has {size} bytes, but {index_file} describes {data_bytes} "
                f"({self.num_tokens} tokens of {self.dtype.name}, dtype code {code}): the two files do not "
                "belong together (a damaged index, or a .bin from another preprocessing). "
                "Fix: re-run `dtmega preprocess` to write both"
            )
        check_index_arrays(index_file, self.sequence_lengths, self.sequence_pointers, self.document_indices,
                           self.dtype.itemsize, data_bytes)
        self.identity = _identity(index_file, data_file)
        if not data_bytes:
            self._data = np.zeros(0, self.dtype)
        elif mmap:
            self._data = np.memmap(data_file, dtype=self.dtype, mode="r", order="C")
        else:
            self._data = _FileReads(data_file, self.dtype, data_bytes // self.dtype.itemsize)

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence `index` from token `offset`, `length` of them (default: to the end)."""
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        if length is None:
            length = int(self.sequence_lengths[index]) - offset
        return self._data[start:start + length]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def document_sequences(self, document: int) -> range:
        """Sequence indices of document `document`."""
        return range(int(self.document_indices[document]), int(self.document_indices[document + 1]))
