"""Reading and writing files as what they claim to be.

Every command opens files a user names (configs, tokenizers, indices, checkpoints, locks,
temporaries). A name can lie: `config.json` can be a link to `/dev/zero` (read until memory runs
out), a FIFO (a read that never returns), or a huge file; a `.tmp` or lock name can be a symlink
planted so that a write lands on a file elsewhere. This module is the one place that decides:

- reads go through `read_regular_bytes` / `read_regular_text` / `read_regular_json`: the file is
  opened without blocking (`O_NONBLOCK`, so a FIFO cannot hang the open), checked with `fstat` on
  the open descriptor (no race between the check and the read) to be a regular file, and read
  only up to a stated size. A symlink to a regular file is read (Hugging Face's cache is made of
  them); a link to a device or a FIFO is refused by what it points to.
- writes go through `create_exclusive` / `write_file_exclusive`: a stale entry of the name is
  removed (a symlink is removed, never followed) and the file is created with
  `O_CREAT | O_EXCL | O_NOFOLLOW`, so nothing is ever written through a link.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from dtmega.kernels.errors import DtmegaError

MiB = 1 << 20
JSON_LIMIT = 64 * MiB  # config.json, tokenizer_config.json, headers: far below this in every real model
TOKENIZER_LIMIT = 1024 * MiB  # tokenizer.json of the largest vocabularies is tens of MiB


class UnsafeFileError(DtmegaError):
    """A file that is not what its name says: not a regular file, too large, or a link where a
    write would follow it."""


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "not a regular file"


def check_regular(path: str | Path, what: str) -> Path:
    """`path` when it (or what its links point to) is a regular file; UnsafeFileError naming
    `what` and the fix otherwise. For readers that open the file themselves (numpy memory maps,
    tokenizers' `from_file`)."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UnsafeFileError(f"{what} {path} does not exist. Fix: point at an existing file") from None
    if not stat.S_ISREG(mode):
        raise UnsafeFileError(f"{what} {path} is {_kind(mode)}, not a regular file; refused unread. "
                              "Fix: replace it with the file itself")
    return path


def read_regular_bytes(path: str | Path, what: str, limit: int = JSON_LIMIT) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes (see the module docstring)."""
    path = Path(path)
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise UnsafeFileError(f"{what} {path} does not exist. Fix: point at an existing file") from None
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFileError(f"{what} {path} is {_kind(info.st_mode)}, not a regular file; refused unread. "
                                  "Fix: replace it with the file itself")
        if info.st_size > limit:
            raise UnsafeFileError(f"{what} {path} holds {info.st_size:,} bytes, more than the {limit:,} such a file "
                                  "can need; refused unread. Fix: the right file")
        chunks, total = [], 0
        while True:  # a file that grows while read is cut at the limit, not followed
            chunk = os.read(handle, min(16 * MiB, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise UnsafeFileError(f"{what} {path} grew past {limit:,} bytes while read; refused. "
                                      "Fix: the right file, not one being written")
        return b"".join(chunks)
    finally:
        os.close(handle)


def read_regular_text(path: str | Path, what: str, limit: int = JSON_LIMIT) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes; undecodable bytes are refused
    by name."""
    data = read_regular_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UnsafeFileError(f"{what} {path} is not UTF-8 text (byte {error.start}: {error.reason}). "
                              "Fix: the right file") from None


def read_regular_json(path: str | Path, what: str, limit: int = JSON_LIMIT) -> Any:
    """The JSON value of a regular file of at most `limit` bytes; malformed JSON (and nesting too
    deep to parse) refused by name."""
    text = read_regular_text(path, what, limit)
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise UnsafeFileError(f"{what} {path} is not valid JSON ({reason}). Fix: the right file") from None


def remove_stale(path: str | Path) -> None:
    """Removes whatever entry `path` names (a leftover temporary, or a planted symlink: the link
    goes, what it points to is untouched); a directory there is refused."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise UnsafeFileError(f"{path} is a directory where dtmega writes a file. Fix: remove or rename it")
    path.unlink()


def create_exclusive(path: str | Path, mode: str = "wb") -> BinaryIO:
    """A new file at `path`, opened for writing, after removing any stale entry of that name;
    created with O_CREAT | O_EXCL | O_NOFOLLOW so a link planted between the removal and the
    creation makes the creation fail rather than write through it."""
    path = Path(path)
    remove_stale(path)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    return os.fdopen(descriptor, mode)


def write_file_exclusive(path: str | Path, data: bytes | str) -> None:
    """Writes `data` into a new file at `path` (see `create_exclusive`): for temporaries that are
    renamed into place afterwards."""
    with create_exclusive(path, "wb") as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)


def replace_from_temporary(path: str | Path, data: bytes | str) -> None:
    """Writes `data` to `path` through `<path>.tmp` created exclusively and renamed over `path`:
    a reader never sees a half-written file and no link is followed (the rename replaces a link
    at `path` itself, never its target)."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    write_file_exclusive(temporary, data)
    os.replace(temporary, path)
