"""One job per `--save` directory at a time.

Two jobs saving into one directory overwrite each other's `.partial` directories and `latest`
(before: a raw FileNotFoundError in one of them, after both had trained). Rank 0 holds an
exclusive `flock` on `DIR/.dtmega-lock` for the life of the run; the file says who holds it.
The kernel drops the lock when the holding process ends, however it ends (a crash, SIGKILL, an
out-of-memory kill), so a lock is never left behind by a dead job and nothing has to break it.
The outcome is broadcast, so every rank of the second job stops with the same message instead of
waiting for rank 0. On filesystems without `flock` support the run goes on with a note.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

import torch.distributed as dist

from dtmega.mesh import broadcast_object
from dtmega.safe_files import read_regular_text
from dtmega.train.checkpoint import CheckpointError

LOCK = ".dtmega-lock"


class SaveLock:
    """The held lock of one `--save` directory (rank 0 only); `release()` or process exit frees it."""

    def __init__(self, directory: Path, handle: int | None):
        self.directory = directory
        self._handle = handle

    def release(self) -> None:
        """Frees the lock (the file stays: removing it would race with the next holder)."""
        if self._handle is not None:
            os.close(self._handle)
            self._handle = None


def _holder(path: Path) -> str:
    try:
        who = json.loads(read_regular_text(path, "the lock file", 4096))
        return f"pid {who['pid']} on {who['host']}, since {who['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process whose details are unreadable"


def _try_lock(directory: Path) -> tuple[int | None, str | None, str | None]:
    """(descriptor, problem, note) for this process's attempt to take the lock."""
    path = directory / LOCK
    refusal = (f"--save {directory}: {path} is {{}}, not the lock file dtmega writes; refused (locking it would write "
               "through it). Fix: remove it, or pass another --save")
    try:  # never through a link, and a FIFO cannot block the open
        handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            return None, refusal.format("a symbolic link"), None
        raise
    if not stat.S_ISREG(os.fstat(handle).st_mode):
        os.close(handle)
        return None, refusal.format("not a regular file"), None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(handle)
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None, (f"--save {directory} is in use by another job ({_holder(path)}): two jobs saving into one "
                          "directory would overwrite each other's checkpoints. Fix: wait for that job to end (the "
                          "lock goes with its process, even after a crash), or pass another --save"), None
        return None, None, f"{directory} does not support file locks ({error.strerror}): no guard against a second job there"
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    os.ftruncate(handle, 0)
    os.write(handle, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}).encode())
    return handle, None, None


def lock_save_dir(directory: str | Path) -> tuple[SaveLock, str | None]:
    """Takes the `--save` lock on rank 0 and tells every rank the outcome: CheckpointError on
    every rank if another job holds it; else the lock and a note (None unless the filesystem
    cannot lock)."""
    directory = Path(directory)
    handle, problem, note = None, None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        handle, problem, note = _try_lock(directory)
    problem, note = broadcast_object((problem, note))
    if problem:
        raise CheckpointError(problem)
    return SaveLock(directory, handle), note
