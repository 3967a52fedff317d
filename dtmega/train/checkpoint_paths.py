"""`--save` and `--load` checked at start-up, before any training they are meant to keep.

- Megatron's launch scripts pass one directory as both `--save` and `--load`, so a restarted
  job resumes by itself; on the first run that directory is empty (or not there yet) and the
  run starts from scratch, with a notice. An explicit `--load` elsewhere that holds nothing is
  still an error (a typo must not silently start a new run).
- `--save` must be a directory this process can write, on a filesystem with room for one
  checkpoint; otherwise the first save would fail after all the training it was meant to keep.

Every rank runs these checks on the same arguments and files, before any process group, so
they fail alike everywhere.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dtmega.passes.render import human_bytes
from dtmega.train.checkpoint import CheckpointError, has_checkpoint
from dtmega.writable import existing_ancestor, make_writable_dir

# Bytes per parameter in a checkpoint: the fp32 weights and AdamW's two fp32 moments.
CHECKPOINT_BYTES_PER_PARAMETER = 12


def fresh_start_note(load: str | None, save: str | None) -> str | None:
    """The notice when `--load` is `--save` and holds no checkpoint yet (the run then starts
    from scratch), else None. A `--load` elsewhere is left to the loader's own errors."""
    if not load or not save or Path(load).resolve() != Path(save).resolve():
        return None
    path = Path(load)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"--load/--save {path} is a file. Fix: pass a directory (it is created if missing)")
    if path.exists() and has_checkpoint(path):
        return None
    return (f"--load {load} is the --save directory and holds no checkpoint yet: starting from scratch "
            "(a restart of this command resumes from the checkpoints it saves there)")


def check_save_dir(save: str, parameters: int, create: bool = True) -> str | None:
    """`save` is (or can be made) a writable directory with room for one checkpoint of a model
    of `parameters` parameters. With `create`, the directory is made and a probe file written
    and removed (what the first save will do), and too little room is an error. Without it (dry
    runs, often on a login node, days before the run), the nearest existing ancestor is checked
    for being a writable directory, and too little room today is returned as a warning."""
    path = Path(save)
    fix = "Fix: pass a --save directory on a writable filesystem (it is created if missing)"
    ancestor = existing_ancestor(path)
    if not ancestor.is_dir():
        raise CheckpointError(f"--save {save}: {ancestor} is a file, not a directory. {fix}")
    if create:
        try:
            make_writable_dir(path)
        except OSError as error:
            raise CheckpointError(f"--save {save} is not writable: {error.strerror} ({error.filename}). {fix}") from None
        ancestor = path
    elif not os.access(ancestor, os.W_OK | os.X_OK):
        raise CheckpointError(f"--save {save}: {ancestor} is not writable by this user. {fix}")
    needed = parameters * CHECKPOINT_BYTES_PER_PARAMETER
    free = shutil.disk_usage(ancestor).free
    if free >= needed:
        return None
    message = (f"--save {save}: its filesystem has {human_bytes(free)} free, but one checkpoint of this model "
               f"takes about {human_bytes(needed)} ({parameters:,} parameters x {CHECKPOINT_BYTES_PER_PARAMETER} "
               "bytes: fp32 weights and AdamW's two moments). Fix: free space there, or pass another --save")
    if create:
        raise CheckpointError(message)
    return f"today {message[0].lower()}{message[1:]}"
