"""Where a command will write, checked before it does any work."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def existing_ancestor(path: Path) -> Path:
    """The nearest of `path` and its parents that exists."""
    while not path.exists():
        path = path.parent
    return path


def make_writable_dir(path: Path) -> None:
    """Makes `path` (and its parents) and writes and removes a probe file in it: what the
    command will do later, done now. Raises OSError (with its strerror and filename) if the
    filesystem refuses, NotADirectoryError if a parent is a file."""
    ancestor = existing_ancestor(path)
    if not ancestor.is_dir():
        raise NotADirectoryError(20, "a file, not a directory", str(ancestor))
    probe = path / f".dtmega-write-probe-{socket.gethostname()}-{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b"")
    probe.unlink()
