"""Whose checkpoints a `--save` directory holds, checked before a run writes there.

Each checkpoint's state.json records the run that wrote it (`run_id`: made by a run that starts
from scratch or from a Hugging Face model, kept by every resume). Before any work:

- a run without `--load` (a fresh start, `--load-hf`, `dtmega convert`) refuses a `--save`
  that already holds checkpoints: its saves would replace them and move `latest` back;
- a resume refuses a `--save` holding another run's checkpoints, or one whose `latest` is
  further along than the step the run starts at (its first save would move `latest` back);
- `--overwrite-checkpoints` does either on purpose, and the run says what it will replace.

`save_checkpoint` enforces the last rule once more at every save (`allow_older`), so no code
path moves `latest` backwards by accident. Every rank runs these checks on the same files
before any process group, so they fail alike everywhere.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

from dtmega.train.checkpoint import (
    LATEST,
    STATE,
    CheckpointError,
    has_checkpoint,
    iterations,
    latest_target,
)

OVERWRITE_FLAG = "--overwrite-checkpoints"


def new_run_id() -> str:
    """A fresh run's identity (only the rank that writes state.json uses it)."""
    return uuid.uuid4().hex[:16]


def iteration_of(checkpoint: Path) -> int:
    """The step an iter_* directory's name says."""
    return int(checkpoint.name.removeprefix("iter_"))


@dataclass(frozen=True)
class SavedRun:
    """What a directory of checkpoints says about the run that wrote it."""

    directory: Path
    newest: Path  # the checkpoint `latest` names (or the newest iter_* if latest is damaged)
    run_id: str | None  # None: written before run ids

    @property
    def step(self) -> int:
        return iteration_of(self.newest)

    def describe(self) -> str:
        who = f"run {self.run_id}" if self.run_id else "a run"
        return f"checkpoints of {who} (latest {self.newest.name}, step {self.step})"


def _run_id(checkpoint: Path) -> str | None:
    try:
        value = json.loads((checkpoint / STATE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def saved_run(directory: str | Path) -> SavedRun | None:
    """The run whose checkpoints `directory` holds, or None when it holds none."""
    directory = Path(directory)
    if not directory.is_dir() or not has_checkpoint(directory):
        return None
    if not (directory / LATEST).exists():  # an iter_* directory itself
        return SavedRun(directory, directory, _run_id(directory))
    newest, _ = latest_target(directory)
    if newest is None or not newest.is_dir():
        found = sorted(iterations(directory), key=iteration_of)
        if not found:
            return None
        newest = found[-1]
    return SavedRun(directory, newest, _run_id(newest))


def _save_dir_of(load: Path) -> Path:
    """The --save directory a --load path belongs to (itself, or the parent of an iter_*)."""
    return load.parent if (load / STATE).exists() and not (load / LATEST).exists() else load


def check_save_ownership(save: str | Path, loaded: Path | None, loaded_state: dict | None,
                         overwrite: bool, command: str = "this run", load_arg: str | None = None) -> list[str]:
    """Refuses (CheckpointError) a `save` whose checkpoints this run would clobber; returns the
    notes to print (what `--overwrite-checkpoints` will replace). `loaded` is the checkpoint
    the run resumes from (None for a fresh start), `loaded_state` its state.json and `load_arg`
    the --load given: a --load of the --save directory itself resumes its newest intact
    checkpoint, which may be behind a damaged `latest` (moving back past it is the recovery)."""
    there = saved_run(save)
    if there is None:
        return []
    fix_other = f"pass another --save, or add {OVERWRITE_FLAG} to write there on purpose"
    if loaded is None:
        if overwrite:
            return [f"{OVERWRITE_FLAG}: {save} holds {there.describe()}; {command} starts over there: its saves "
                    "replace the checkpoints of the same steps and move latest to its own"]
        raise CheckpointError(
            f"--save {save} holds {there.describe()}, and {command} does not resume it (no --load): its saves would "
            f"replace them and move latest back. Fix: pass --load {save} to resume that run, or {fix_other}")
    notes = []
    ours = (loaded_state or {}).get("run_id")
    same_place = _save_dir_of(Path(loaded)).resolve() == Path(save).resolve()
    if (there.run_id and ours and there.run_id != ours) or (not same_place and not (there.run_id and ours)):
        if not overwrite:
            raise CheckpointError(
                f"--save {save} holds {there.describe()}, but this run resumes {loaded} "
                f"({'run ' + ours if ours else 'a run written before run ids'}): its saves would mix two runs' "
                f"checkpoints. Fix: --save where {loaded} was saved, or {fix_other}")
        notes.append(f"{OVERWRITE_FLAG}: {save} holds {there.describe()}; this run's saves join them")
    start = int((loaded_state or {}).get("iteration", 0))
    resumes_the_directory = load_arg is not None and Path(load_arg).resolve() == Path(save).resolve()
    if start < there.step and not resumes_the_directory:
        if not overwrite:
            raise CheckpointError(
                f"--save {save}: its latest is {there.newest.name} (step {there.step}), but this run starts at step "
                f"{start} ({loaded}): its first save would move latest back. Fix: --load {save} to resume from step "
                f"{there.step}, or add {OVERWRITE_FLAG} to continue from step {start} (latest then follows this run; "
                "the later checkpoints stay on disk until you remove them)")
        notes.append(f"{OVERWRITE_FLAG}: this run starts at step {start}, behind {save}'s latest ({there.newest.name}): "
                     "latest will move back to this run's saves")
    return notes
