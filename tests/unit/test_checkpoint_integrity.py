"""Checkpoint manifests (issue 18): every file's size and CRC-32 written at save and verified at
load; `--load DIR` falls back from a damaged checkpoint to the newest intact one, an explicit
iter_* path never does; damage is named in one line. Before: a shard with 400 bytes inverted
loaded and resumed (loss 60,132), a deleted shard or .metadata gave a 188-line DCP traceback."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from dtmega.train.checkpoint import CheckpointError, resolve_checkpoint, select_checkpoint
from dtmega.train.checkpoint_manifest import MANIFEST, file_checksum
from dtmega.train.restore import read_head
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args

RUN = {"train_iters": 3, "save_interval": 1, "eval_iters": 0, "log_interval": 1}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("corpus"), documents=120)


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory) -> tuple[Path, list[float]]:
    """A --save directory with iter_1..3 (each with its manifest) and the run's losses."""
    save = tmp_path_factory.mktemp("saved") / "ckpt"
    result = train(tiny_args(corpus, save=str(save), **RUN))
    return save, result.losses


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    """A fresh copy of the saved checkpoints to damage."""
    target = tmp_path / "ckpt"
    shutil.copytree(saved[0], target)
    return target


def _shard(checkpoint: Path) -> Path:
    return min(checkpoint.glob("*.distcp"))


def _invert(path: Path, start: int, count: int = 400) -> None:
    data = bytearray(path.read_bytes())
    data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
    path.write_bytes(bytes(data))


def test_every_file_is_in_the_manifest_with_its_size_and_checksum(saved):
    checkpoint = resolve_checkpoint(saved[0])
    files = json.loads((checkpoint / MANIFEST).read_text())["files"]
    on_disk = {p.name for p in checkpoint.iterdir() if p.name != MANIFEST}
    assert set(files) == on_disk and {".metadata", "state.json", "tokenizer.json", "rng_rank00000.pt"} <= on_disk
    for name, entry in files.items():
        assert (entry["size"], entry["crc32"]) == file_checksum(checkpoint / name)


DAMAGE = {
    "inverted_bytes": (lambda c: _invert(_shard(c), _shard(c).stat().st_size // 2), r"\.distcp does not match its checksum"),
    "deleted_shard": (lambda c: _shard(c).unlink(), r"\.distcp is missing"),
    "truncated_shard": (lambda c: _shard(c).write_bytes(_shard(c).read_bytes()[:-100]),
                        r"\.distcp has \d+ bytes, but the manifest says \d+ \(truncated or replaced\)"),
    "deleted_metadata": (lambda c: (c / ".metadata").unlink(), r"\.metadata is missing"),
    "deleted_manifest": (lambda c: (c / MANIFEST).unlink(), r"manifest\.json is missing"),
    "garbled_manifest": (lambda c: (c / MANIFEST).write_text("{"), r"manifest\.json is damaged"),
    "manifest_entry_without_size": (
        lambda c: (c / MANIFEST).write_text(json.dumps({"algorithm": "crc32", "files": {".metadata": {"crc32": "0"}}})),
        r"manifest\.json is damaged"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damage_is_named_in_one_line_and_the_save_directory_falls_back(copy, damage):
    """Each kind of damage to the latest checkpoint: the notice names the file and what is wrong
    with it, and the newest intact checkpoint (iter_2) is chosen; the explicit iter_3 path is an
    error naming the same file, never a fallback."""
    make, problem = DAMAGE[damage]
    make(copy / "iter_0000003")
    chosen, notes = select_checkpoint(copy)
    assert chosen.name == "iter_0000002"
    assert len(notes) == 2 and "CHECKPOINT iter_0000003 IS DAMAGED" in notes[0]
    assert re.search(problem, notes[0]), notes[0]
    assert "falling back to iter_0000002" in notes[1]
    with pytest.raises(CheckpointError, match=problem + ".*never falls back") as error:
        select_checkpoint(copy / "iter_0000003")
    assert "\n" not in str(error.value)


def test_sizes_only_check_misses_flipped_bits_but_checksums_do_not(copy):
    """`contents=False` (used before the process group, to read the config) checks presence and
    sizes; the checksums at load catch what keeps the size."""
    _invert(_shard(copy / "iter_0000003"), 1000)
    assert select_checkpoint(copy, contents=False)[0].name == "iter_0000003"
    assert select_checkpoint(copy)[0].name == "iter_0000002"


def test_no_intact_checkpoint_lists_each_one(copy):
    for name in ("iter_0000001", "iter_0000002", "iter_0000003"):
        _shard(copy / name).unlink()
    with pytest.raises(CheckpointError, match="no intact checkpoint there") as error:
        select_checkpoint(copy)
    assert str(error.value).count(".distcp is missing") == 3


def test_a_resume_falls_back_to_the_newest_intact_checkpoint_and_reproduces_the_losses(corpus, saved, copy, capsys):
    """400 bytes inverted in the latest checkpoint's shard (issue 18's case 7, which before
    resumed at loss 60,132): the resume says so loudly, loads iter_2 and retrains step 3 with the
    uninterrupted run's loss (same data, seed and state: equal up to the last bits of fp32)."""
    _invert(_shard(copy / "iter_0000003"), _shard(copy / "iter_0000003").stat().st_size // 2)
    resumed = train(tiny_args(corpus, load=str(copy), **RUN))
    out = capsys.readouterr().out
    assert "CHECKPOINT iter_0000003 IS DAMAGED" in out and "does not match its checksum" in out
    assert "resumed from" in out and "iter_0000002 at step 2" in out
    assert resumed.losses == pytest.approx(saved[1][2:], rel=1e-5)


def test_generate_and_evaluate_fall_back_too(copy, capsys):
    (copy / "iter_0000003" / ".metadata").unlink()
    head = read_head(copy)
    assert head.checkpoint.name == "iter_0000002"
    assert "CHECKPOINT iter_0000003 IS DAMAGED" in capsys.readouterr().err


def test_checkpoints_from_before_manifests_still_load(copy):
    """A checkpoint written before this change has no manifest and no promise of one in its
    state.json: checked for its index files only, and loaded."""
    latest = copy / "iter_0000003"
    (latest / MANIFEST).unlink()
    state = json.loads((latest / "state.json").read_text())
    del state["manifest"]
    (latest / "state.json").write_text(json.dumps(state))
    assert select_checkpoint(copy) == (latest, [])
