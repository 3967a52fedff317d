"""Reliability matrix 3, the file rows (F10-F12, T6, T7): a file is read as what it claims to be
and nothing is written through a link. Before: `config.json`/`tokenizer.json` linked to
/dev/zero were read until memory ran out, a FIFO hung the command, a `.dtmega-lock` or `.bin.tmp`
symlink made `train`/`preprocess` overwrite the file it pointed to."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from dtmega.safe_files import UnsafeFileError, create_exclusive, read_regular_bytes, read_regular_json, replace_from_temporary
from tests.hf_models import save_tiny_llama31


def _no_hang(function, seconds: float = 20.0):
    """Runs `function` in a thread and fails (instead of hanging the suite) if it blocks: what a
    FIFO did to the readers before."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"{function} blocked for {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "huge"])
def test_the_reader_refuses_what_is_not_a_regular_file_of_its_size(tmp_path, kind):
    path = tmp_path / "config.json"
    if kind == "dev_zero":
        path.symlink_to("/dev/zero")
        message = r"config.json is a device, not a regular file; refused unread"
    elif kind == "fifo":
        os.mkfifo(path)
        message = r"config.json is a FIFO, not a regular file; refused unread"
    else:
        path.write_bytes(b" " * 2048)
        message = r"config.json holds 2,048 bytes, more than the 1,024"
    with pytest.raises(UnsafeFileError, match=message):
        _no_hang(lambda: read_regular_bytes(path, "the config", limit=1024))


def test_a_link_to_a_regular_file_is_read(tmp_path):
    """Hugging Face's cache is made of links into its blobs: those must keep working."""
    (tmp_path / "blob").write_text(json.dumps({"a": 1}))
    (tmp_path / "config.json").symlink_to(tmp_path / "blob")
    assert read_regular_json(tmp_path / "config.json", "the config") == {"a": 1}


@pytest.mark.parametrize("name, kind", [("config.json", "dev_zero"), ("config.json", "fifo"),
                                        ("tokenizer.json", "dev_zero"), ("tokenizer.json", "fifo"),
                                        ("tokenizer_config.json", "dev_zero")])
def test_a_hugging_face_directory_with_a_lying_file_is_refused_unread(tmp_path, name, kind):
    """F10 (config.json -> /dev/zero), F11 (a FIFO), F12 (tokenizer.json / tokenizer_config.json)."""
    from dtmega.interop.hf_checkpoint import HFCheckpoint

    directory = save_tiny_llama31(tmp_path / "hf")
    if name == "tokenizer_config.json" and not (directory / name).exists():
        (directory / name).write_text("{}")
    (directory / name).unlink()
    if kind == "fifo":
        os.mkfifo(directory / name)
    else:
        (directory / name).symlink_to("/dev/zero")
    what = "a FIFO" if kind == "fifo" else "a device"
    with pytest.raises(UnsafeFileError, match=rf"{name} is {what}, not a regular file; refused unread"):
        _no_hang(lambda: HFCheckpoint.open(directory))


def test_a_chat_template_that_is_a_fifo_is_refused_unread(tmp_path):
    from dtmega.data.chat_template import ChatTemplate

    os.mkfifo(tmp_path / "chat.jinja")
    with pytest.raises(UnsafeFileError, match=r"chat.jinja is a FIFO"):
        _no_hang(lambda: ChatTemplate.load(tmp_path / "chat.jinja"))


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    """T6: `_try_lock` opened `.dtmega-lock` following links, truncated and wrote it: the file a
    planted link named (here victim.txt) was overwritten with the lock's JSON."""
    from dtmega.train.checkpoint import CheckpointError
    from dtmega.train.save_lock import LOCK, lock_save_dir

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    save = tmp_path / "ck"
    save.mkdir()
    (save / LOCK).symlink_to(victim)
    with pytest.raises(CheckpointError, match=rf"{LOCK} is a symbolic link, not the lock file dtmega writes; refused"):
        lock_save_dir(save)
    assert victim.read_text() == "precious"
    (save / LOCK).unlink()
    os.mkfifo(save / LOCK)
    with pytest.raises(CheckpointError, match=r"is not a regular file, not the lock file"):
        _no_hang(lambda: lock_save_dir(save))


def test_preprocess_never_writes_through_a_planted_temporary(tmp_path):
    """T7: `<prefix>_text_document.bin.tmp -> victim` made preprocess replace the victim with token
    bytes, and the output .bin became that link. Now the link is removed, the victim untouched, and
    the outputs are regular files."""
    from dtmega.data.indexed import IndexedDataset, IndexedDatasetWriter, bin_path, idx_path

    victim = tmp_path / "victim2.txt"
    victim.write_text("precious")
    prefix = tmp_path / "pp" / "sym_text_document"
    prefix.parent.mkdir()
    for name in (f"{bin_path(prefix)}.tmp", f"{idx_path(prefix)}.tmp", f"{prefix}.stats.json.tmp"):
        os.symlink(victim, name)
    writer = IndexedDatasetWriter(prefix, np.uint16)
    writer.add_document([np.array([1, 2, 3])])
    writer.finalize()
    assert victim.read_text() == "precious"
    for path in (bin_path(prefix), idx_path(prefix)):
        assert path.is_file() and not path.is_symlink()
    assert len(IndexedDataset(prefix)) == 1


def test_exclusive_creation_never_follows_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "out.tmp").symlink_to(victim)
    with create_exclusive(tmp_path / "out.tmp") as handle:
        handle.write(b"new")
    assert victim.read_text() == "precious" and (tmp_path / "out.tmp").read_bytes() == b"new"
    (tmp_path / "final.json").symlink_to(victim)
    (tmp_path / "final.json.tmp").symlink_to(victim)
    replace_from_temporary(tmp_path / "final.json", "{}")
    assert victim.read_text() == "precious" and not (tmp_path / "final.json").is_symlink()
