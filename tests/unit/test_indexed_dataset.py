"""Megatron's indexed dataset format, byte for byte, in both directions, and its errors."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from dtmega.data.indexed import DatasetFormatError, IndexedDataset, IndexedDatasetWriter, token_dtype

DOCUMENTS = [[[5, 6, 7]], [[1], [2, 3]], [], [[9] * 40]]  # documents of sequences; one empty document


def write(prefix, dtype=np.uint16):
    writer = IndexedDatasetWriter(prefix, dtype)
    for document in DOCUMENTS:
        writer.add_document([np.array(s) for s in document])
    writer.finalize()


def test_index_bytes_are_megatrons_layout(tmp_path):
    write(tmp_path / "d")
    lengths = [3, 1, 2, 40]
    pointers = [0, 6, 8, 12]  # byte offsets of uint16 tokens
    documents = [0, 1, 3, 3, 4]
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<Q", 4)
                + struct.pack("<Q", 5) + np.array(lengths, np.int32).tobytes() + np.array(pointers, np.int64).tobytes()
                + np.array(documents, np.int64).tobytes())
    assert (tmp_path / "d.idx").read_bytes() == expected
    assert (tmp_path / "d.bin").read_bytes() == np.array([5, 6, 7, 1, 2, 3] + [9] * 40, np.uint16).tobytes()


def test_megatron_reads_what_dtmega_writes(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset

    write(tmp_path / "d")
    theirs = MegatronDataset(str(tmp_path / "d"))
    ours = IndexedDataset(tmp_path / "d")
    assert len(theirs) == len(ours) == 4
    assert list(theirs.document_indices) == list(ours.document_indices)
    for i in range(4):
        assert np.array_equal(theirs[i], ours[i])


def test_dtmega_reads_what_megatron_writes(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    for document in DOCUMENTS:
        flat = [t for s in document for t in s]
        builder.add_document(torch.tensor(flat, dtype=torch.int64), [len(s) for s in document])
    builder.finalize(str(tmp_path / "m.idx"))
    ours = IndexedDataset(tmp_path / "m")
    assert ours.dtype == np.int32 and ours.num_documents == 4
    assert [list(ours[i]) for i in range(4)] == [[5, 6, 7], [1], [2, 3], [9] * 40]
    write(tmp_path / "d", np.int32)
    assert (tmp_path / "d.idx").read_bytes() == (tmp_path / "m.idx").read_bytes()
    assert (tmp_path / "d.bin").read_bytes() == (tmp_path / "m.bin").read_bytes()


def test_token_dtype_follows_megatron():
    assert token_dtype(50000) == np.uint16 and token_dtype(65500) == np.int32 and token_dtype(128256) == np.int32


def test_wrong_magic(tmp_path):
    write(tmp_path / "d")
    data = bytearray((tmp_path / "d.idx").read_bytes())
    data[:3] = b"XXX"
    (tmp_path / "d.idx").write_bytes(bytes(data))
    with pytest.raises(DatasetFormatError, match="does not start with Megatron's index magic"):
        IndexedDataset(tmp_path / "d")


def test_wrong_version(tmp_path):
    write(tmp_path / "d")
    data = bytearray((tmp_path / "d.idx").read_bytes())
    data[9:17] = struct.pack("<Q", 2)
    (tmp_path / "d.idx").write_bytes(bytes(data))
    with pytest.raises(DatasetFormatError, match="index version 2"):
        IndexedDataset(tmp_path / "d")


def test_truncated_bin_and_idx(tmp_path):
    write(tmp_path / "d")
    full = (tmp_path / "d.bin").read_bytes()
    (tmp_path / "d.bin").write_bytes(full[:-10])
    with pytest.raises(DatasetFormatError, match=r"d.bin is truncated: 82 bytes, but .* describes 92"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.bin").write_bytes(full)
    (tmp_path / "d.idx").write_bytes((tmp_path / "d.idx").read_bytes()[:-8])
    with pytest.raises(DatasetFormatError, match="d.idx is truncated"):
        IndexedDataset(tmp_path / "d")


def test_index_and_data_must_agree_exactly(tmp_path):
    """A .bin longer than its index describes is refused, not read as other tokens: here the
    index's dtype code is changed from uint16 (8) to uint8 (1), so it describes half the bytes."""
    write(tmp_path / "d")
    data = bytearray((tmp_path / "d.idx").read_bytes())
    assert data[17] == 8
    data[17] = 1
    (tmp_path / "d.idx").write_bytes(bytes(data))
    with pytest.raises(DatasetFormatError, match=r"d.bin has 92 bytes, but .*d.idx describes 46 .*uint8, dtype code 1"
                                                 r".*do not belong together"):
        IndexedDataset(tmp_path / "d")
    write(tmp_path / "d")
    (tmp_path / "d.bin").write_bytes((tmp_path / "d.bin").read_bytes() + b"\0\0")
    with pytest.raises(DatasetFormatError, match="d.bin has 94 bytes, but"):
        IndexedDataset(tmp_path / "d")


def test_damaged_pointers_are_refused(tmp_path):
    write(tmp_path / "d")
    data = bytearray((tmp_path / "d.idx").read_bytes())
    last_pointer = 9 + 8 + 1 + 8 + 8 + 4 * 4 + 3 * 8
    data[last_pointer:last_pointer + 8] = struct.pack("<q", 14)
    (tmp_path / "d.idx").write_bytes(bytes(data))
    with pytest.raises(DatasetFormatError, match="sequence 3's pointer is 14, but sequence 2 starts at 8 and holds 2"):
        IndexedDataset(tmp_path / "d")


LENGTHS_AT = 9 + 8 + 1 + 8 + 8  # after the magic, version, dtype code and the two counts
POINTERS_AT = LENGTHS_AT + 4 * 4


def _damage(prefix, at, fmt, value):
    data = bytearray((prefix.parent / f"{prefix.name}.idx").read_bytes())
    data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    (prefix.parent / f"{prefix.name}.idx").write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    # matrix-3 D1: middle pointers that lie while the last one holds (one at 0, one past the .bin)
    ((POINTERS_AT + 8, "<q", 0), r"sequence 1's pointer is 0, but sequence 0 starts at 0 and holds 3 tokens"),
    ((POINTERS_AT + 16, "<q", 10**12), r"sequence 2's pointer is 1000000000000, but sequence 1 starts at 6"),
    ((POINTERS_AT, "<q", 2), r"sequence 1's pointer is 6, but sequence 0 starts at 2 and holds 3"),
    # matrix-3 D2: a negative length, the sum of lengths and the last pointer kept
    ((LENGTHS_AT, "<i", -1), r"sequence 0 has the negative length -1"),
    # document boundaries out of order or past the sequences
    ((POINTERS_AT + 4 * 8 + 8, "<q", 9), r"document boundaries do not run from 0 to its 4 sequences in order"),
])
def test_every_pointer_and_length_of_the_index_is_checked(tmp_path, damage, message):
    """Matrix-3 D1/D2: before, only the last pointer was compared, and training read another
    document's bytes (or a slice to the end for a negative length) without a word."""
    write(tmp_path / "d")
    if "negative" in message:  # keep the lengths' sum (and so the .bin size check) intact, as the matrix's file did
        _damage(tmp_path / "d", LENGTHS_AT + 4, "<i", 1 + 3 + 1)  # 3 + 1 = -1 + 5
    _damage(tmp_path / "d", *damage)
    with pytest.raises(DatasetFormatError, match=message):
        IndexedDataset(tmp_path / "d")


def test_a_fifo_or_device_named_as_the_data_is_refused_unread(tmp_path):
    """Matrix-3's file rule: a FIFO at the .bin's name would block the open forever."""
    import os

    write(tmp_path / "d")
    (tmp_path / "d.bin").unlink()
    os.mkfifo(tmp_path / "d.bin")
    from dtmega.safe_files import UnsafeFileError

    with pytest.raises(UnsafeFileError, match=r"d.bin is a FIFO, not a regular file; refused unread"):
        IndexedDataset(tmp_path / "d")


@pytest.mark.parametrize("planted, kind", [("d.bin", "a device"), ("d.idx", "a FIFO")])
def test_a_link_to_a_device_or_a_fifo_index_is_refused_unread(tmp_path, monkeypatch, planted, kind):
    """docs/reliability.md, start-up item 5: each dataset's "both files regular (no FIFO, device
    or link to one)". `d.bin` a symbolic link to /dev/zero, or `d.idx` a FIFO: refused naming the
    file and what it is, and never opened (an open of the FIFO would block forever, a read of
    /dev/zero never end; the spy fails the test at the first open instead)."""
    import builtins
    import os

    write(tmp_path / "d")
    (tmp_path / planted).unlink()
    if planted == "d.bin":
        os.symlink("/dev/zero", tmp_path / planted)
    else:
        os.mkfifo(tmp_path / planted)
    real_open = builtins.open

    def spy(file, *args, **kwargs):
        assert os.path.basename(os.fspath(file)) not in ("d.bin", "d.idx"), f"{file} was opened"
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(np, "memmap", lambda *a, **k: pytest.fail(f"{a[0]} was mapped"))
    from dtmega.safe_files import UnsafeFileError

    with pytest.raises(UnsafeFileError, match=rf"{planted} is {kind}, not a regular file; refused unread\. Fix: "):
        IndexedDataset(tmp_path / "d")


@pytest.mark.parametrize("count, message", [
    (1000, r"d.idx is truncated: 122 bytes, but its header describes 12074"),
    (2, r"d.bin has 92 bytes, but .*d.idx describes 8 .*do not belong together"),
    (0, r"d.bin has 92 bytes, but .*d.idx describes 0 .*do not belong together"),
])
def test_a_damaged_sequence_count_is_named_as_the_index(tmp_path, count, message):
    """The issue's case: a corrupted sequence count in the header was blamed on "use more data"."""
    write(tmp_path / "d")
    data = bytearray((tmp_path / "d.idx").read_bytes())
    data[18:26] = struct.pack("<q", count)  # after the magic (9), version (8) and dtype code (1)
    (tmp_path / "d.idx").write_bytes(bytes(data))
    with pytest.raises(DatasetFormatError, match=message):
        IndexedDataset(tmp_path / "d")


def test_identity_names_the_corpus_not_the_copy(tmp_path):
    """The sample-index cache key: the same files copied elsewhere keep it; another corpus
    preprocessed into the same prefix changes it."""
    write(tmp_path / "d")
    first = IndexedDataset(tmp_path / "d").identity
    (tmp_path / "copy").mkdir()
    for suffix in (".bin", ".idx"):
        (tmp_path / "copy" / f"d{suffix}").write_bytes((tmp_path / f"d{suffix}").read_bytes())
    assert IndexedDataset(tmp_path / "copy" / "d").identity == first
    writer = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    writer.add_document([np.array([1, 2, 3, 4])])
    writer.finalize()
    assert IndexedDataset(tmp_path / "d").identity != first


def test_missing_files_name_the_prefix_convention(tmp_path):
    with pytest.raises(FileNotFoundError, match="pass the prefix without .bin/.idx"):
        IndexedDataset(tmp_path / "nothing")


def test_aborted_writer_leaves_nothing(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    writer.add_document([np.array([1, 2])])
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_file_reads_give_the_memory_maps_tokens(tmp_path):
    """--no-mmap-bin-files (Megatron's switch): the .bin read with positioned file reads gives the
    tokens the memory map gives, for whole sequences and any window of one, and the GPT samples
    built over it are the same."""
    from dtmega.data.blend import DataConfig, build_datasets

    writer = IndexedDatasetWriter(tmp_path / "c", np.uint16)
    rng = np.random.RandomState(1)
    for _ in range(30):
        writer.add_document([rng.randint(0, 60000, size=rng.randint(1, 90))])
    writer.finalize()
    mapped, read = IndexedDataset(tmp_path / "c"), IndexedDataset(tmp_path / "c", mmap=False)
    assert isinstance(mapped._data, np.memmap) and not isinstance(read._data, np.memmap)
    for index in range(len(mapped)):
        assert np.array_equal(mapped.get(index), read.get(index))
        assert np.array_equal(mapped.get(index, 1, 3), read.get(index, 1, 3))
    samples = [build_datasets(DataConfig((str(tmp_path / "c"),), (1.0, 0.0, 0.0), 16, 3, mmap=mmap),
                              {"train": 40})["train"] for mmap in (True, False)]
    assert all(np.array_equal(samples[0][i], samples[1][i]) for i in range(40))
