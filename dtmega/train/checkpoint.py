"""Checkpoints with torch.distributed.checkpoint: sharded, atomic, loadable under any plan.

Layout of `--save DIR`:

    DIR/latest                   name of the newest complete checkpoint (replaced atomically)
    DIR/iter_0000100/            DCP shards of model + optimizer, state.json, tokenizer.json,
                                 rng_rank*.pt, manifest.json (size and CRC-32 of every file)
    DIR/.iter_0000200.partial/   a save in progress (never read)

A save writes everything into the `.partial` directory, renames it to `iter_*` only when every
rank has finished, and then points `latest` at it. A process killed mid-save leaves `latest`
on the previous checkpoint (with --async-save the shards are written by a background thread
and the rename waits for every rank's write: `SaveInProgress`). Loading verifies the manifest
(checkpoint_manifest.py); `--load DIR` falls back from a damaged checkpoint to the newest
intact one, loudly. Everything is read as data
(dtmega/checkpoint_reader.py, `weights_only` RNG states), and `latest` never names a directory
outside DIR.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dtmega.checkpoint_reader import is_file_name, load_dcp, read_dcp_metadata
from dtmega.kernels.errors import DtmegaError
from dtmega.mesh import gather_objects
from dtmega.safe_files import write_file_exclusive
from dtmega.stop_signals import Stopped
from dtmega.train.checkpoint_manifest import (
    MANIFEST,
    Verdict,
    verify_checkpoint,
    write_manifest,
)
from dtmega.train.tied_state import drop_copies, fill_copies, read_copies_as_their_weights, tied_copies

# Optimizer state keyed per parameter FQN ("param_groups.<fqn>.lr"), so that ranks holding
# different parameters (pipeline stages) never overwrite each other's groups.
OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

LATEST = "latest"
STATE = "state.json"
TOKENIZER = "tokenizer.json"
FORMAT = "dtmega-checkpoint-v1"


class CheckpointError(DtmegaError):
    """A checkpoint cannot be used as asked; the message says why and what to do."""


def _leader() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write_file_exclusive(tmp, text)  # a planted link at the temporary's name is removed, not followed
    os.replace(tmp, path)


def save_checkpoint(
    root: str | Path, iteration: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any], tokenizer_json: str | None = None, runtime: dict[str, torch.Tensor] | None = None,
    allow_older: bool = False,
) -> Path:
    """Saves model, optimizer, RNG, the plan's run-time state (`runtime`: FP8 amax histories,
    ...) and `state` (iteration, data position, config, ...) as `root/iter_<iteration>`;
    collective over every rank. `latest` never moves back to an older step unless
    `allow_older` (--overwrite-checkpoints): checked on every rank before anything is written."""
    return SaveInProgress.start(root, iteration, model, optimizer, state, tokenizer_json, runtime, allow_older).finish()


class SaveInProgress:
    """One checkpoint being saved. `start` (collective) checks `latest`, snapshots everything the
    checkpoint holds (the random state too) and writes the DCP shards, in the calling thread, or,
    with `background_group`, on a copy in a background thread (DCP's `async_save`, its
    collectives on that group) while training goes on. `finish` (collective) waits for the
    shards, writes the small files and the manifest, and only then renames `.partial` to
    `iter_*` and points `latest` at it: a run that dies before `finish` leaves `latest` as it was."""

    def __init__(self, root: Path, final: Path, partial: Path, write: Future | None, problem: str | None,
                 own_files: dict[str, Any], retain_interval: int | None = None):
        self.root, self.final, self.partial = root, final, partial
        self._write, self._problem, self._own_files = write, problem, own_files
        self.retain_interval = retain_interval

    @classmethod
    def start(cls, root: str | Path, iteration: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
              state: dict[str, Any], tokenizer_json: str | None = None, runtime: dict[str, torch.Tensor] | None = None,
              allow_older: bool = False, background_group: dist.ProcessGroup | None | bool = False,
              retain_interval: int | None = None) -> SaveInProgress:
        """Begins the save; `background_group`: False writes here, None or a (gloo) group writes
        in the background (None: the default group, for a single process). `retain_interval`
        (Megatron's --save-retain-interval): once published, the checkpoint `latest` named before
        is deleted unless its step is a multiple of it."""
        root = Path(root)
        final = root / f"iter_{iteration:07d}"
        partial = root / f".{final.name}.partial"
        if not allow_older and (root / LATEST).exists():
            newest, _ = latest_target(root)
            if newest is not None and int(newest.name.removeprefix("iter_")) > iteration:
                raise CheckpointError(
                    f"saving step {iteration} into {root} would move its latest back from {newest.name}. Fix: resume "
                    f"with --load {root}, save elsewhere, or pass --overwrite-checkpoints to do so on purpose")
        if _leader():
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        _barrier()
        shards: dict[str, Any] = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            shards["optimizer"] = get_optimizer_state_dict(model, optimizer, options=OPTIMIZER_OPTIONS)
        # a tied weight once: its copies (a tied output layer, a pipeline's last-stage copy) are left out
        drop_copies(shards["model"], shards.get("optimizer"), tied_copies(model, shards["model"]))
        if runtime:
            shards["runtime"] = dict(runtime)
        own_files = {"rng": {"cpu": torch.get_rng_state(),  # the state at this step, however late it is written
                             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                     "state": {"format": FORMAT, "manifest": MANIFEST, **state}, "tokenizer": tokenizer_json}
        write, problem = None, None
        if background_group is False:
            problem = _write_shards(lambda: dcp.save(shards, checkpoint_id=str(partial)))
        else:  # staged: DCP copies every shard to host memory before it returns, then writes the copy
            write = dcp.async_save(shards, checkpoint_id=str(partial), process_group=background_group)
        return cls(root, final, partial, write, problem, own_files, retain_interval)

    def written(self) -> bool:
        """Whether this rank's shards are on disk (always, for a save written in place)."""
        return self._write is None or self._write.done()

    def finish(self) -> Path:
        """Collective: waits for the shards, writes the rest, publishes; every rank raises the same
        CheckpointError if any rank's part failed (the partial save removed, `latest` untouched)."""
        problem = self._problem
        if self._write is not None:
            write, self._write = self._write, None
            problem = _write_shards(write.result)
        rank = dist.get_rank() if dist.is_initialized() else 0
        root, partial, final, own = self.root, self.partial, self.final, self._own_files

        def write_own_files() -> None:
            torch.save(own["rng"], partial / f"rng_rank{rank:05d}.pt")
            if _leader():
                (partial / STATE).write_text(json.dumps(own["state"], indent=2))
                if own["tokenizer"] is not None:
                    (partial / TOKENIZER).write_text(own["tokenizer"])

        def publish() -> None:
            if _leader():
                previous = latest_target(root)[0] if (root / LATEST).exists() else None
                if final.is_symlink():  # an iter_* linked from elsewhere: the link goes, its target stays untouched
                    final.unlink()
                elif final.exists():  # saving the same iteration again: swap the old one out first
                    stale = root / f".{final.name}.stale"
                    shutil.rmtree(stale, ignore_errors=True)
                    os.replace(final, stale)
                    shutil.rmtree(stale)
                os.replace(partial, final)
                _write_atomic(root / LATEST, final.name)
                retire_unretained(previous, final, self.retain_interval)

        if problem is None:
            problem = _attempt(write_own_files, rank)
        _fail_together(problem, root, partial, final)
        _fail_together(_attempt(lambda: write_manifest(partial, [".metadata", STATE, TOKENIZER]), rank), root, partial,
                       final)
        _fail_together(_attempt(publish, rank), root, partial, final)
        return final


def retire_unretained(previous: Path | None, published: Path, retain_interval: int | None) -> None:
    """--save-retain-interval N, as Megatron: once `published` is the latest, the checkpoint that
    was latest before it is deleted unless its step is a multiple of N (so the newest and every
    N-th step remain). A linked iter_* loses only its link; nothing else in the directory is touched."""
    if retain_interval is None or previous is None or previous.resolve() == published.resolve():
        return
    step = int(previous.name.removeprefix("iter_"))
    if step <= 0 or step % retain_interval == 0:
        return
    if previous.is_symlink():
        previous.unlink()
    else:
        shutil.rmtree(previous, ignore_errors=True)


def _write_shards(write: Callable[[], Any]) -> str | None:
    """Runs DCP's write of the shards; an OSError on any writer becomes a one-line problem (DCP
    gathers every writer's error, so every rank is here with the same one)."""
    try:
        write()
        return None
    except CheckpointException as wrapped:
        own = wrapped.failures.get(dist.get_rank() if dist.is_initialized() else 0)
        if own is not None and isinstance(own[0], (KeyboardInterrupt, Stopped)):
            raise own[0] from None  # Ctrl-C or SIGTERM inside the write (DCP wraps every exception): a stop
        problem = _os_problem(wrapped)
        if problem is None:
            raise
        return problem


def _attempt(step, rank: int) -> str | None:
    """Runs this rank's part of a save; an OSError (a full disk, a vanished directory) becomes
    a one-line problem that `_fail_together` shares with every rank instead of a hang."""
    try:
        step()
        return None
    except OSError as error:
        return _os_line(rank, error, "writing")


def _os_problem(wrapped: CheckpointException) -> str | None:
    for rank, (error, _) in sorted(wrapped.failures.items()):
        if isinstance(error, OSError):
            return _os_line(rank, error, "writing its shard")
    return None


def _os_line(rank: int, error: OSError, doing: str) -> str:
    return f"rank {rank}: {error.strerror or error} ({error.filename or doing})"


def _fail_together(problem: str | None, root: Path, partial: Path, final: Path) -> None:
    """Collective: if any rank's part of the save failed, every rank raises the same
    CheckpointError; the partial save is removed and `latest` left as it was."""
    problems = [p for p in gather_objects(problem) if p]
    if not problems:
        return
    if _leader():
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    newest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    kept = f"latest still names {newest}" if newest else "no earlier checkpoint exists there"
    raise CheckpointError(
        f"saving {final.name} into {root} failed: {problems[0]}; the partial save was removed and {kept}. Fix: free "
        f"space on that filesystem (or pass another --save), then resume with --load {root}")


_ITERATION = re.compile(r"iter_\d{7,}")


def _inside(root: Path, target: Path) -> bool:
    return target.resolve().parent == root.resolve()


def latest_target(root: Path) -> tuple[Path | None, str | None]:
    """The checkpoint `root/latest` names, or (None, why) when the file is damaged (empty, not
    text, not an iter_* name): the caller falls back or says so. A name that leads out of
    `root` (a path, `..`, a symlink elsewhere) is refused outright: a checkpoint file never
    decides which directory is read."""
    file = root / LATEST
    try:
        name = file.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"{file} is damaged (not text)"
    if not name:
        return None, f"{file} is empty"
    target = root / name
    if not is_file_name(name) or name.startswith("..") or (target.is_symlink() and not _inside(root, target)):
        raise CheckpointError(
            f"{file} names {name!r}, which leads out of {root}: refused (another directory's checkpoint is never "
            f"loaded through it). Fix: write the name of one of {root}'s iter_* checkpoints into it, or pass the "
            "other checkpoint to --load yourself")
    if not _ITERATION.fullmatch(name):
        return None, f"{file} is damaged (it holds {name[:40]!r}, not an iter_* name)"
    return target, None


def iterations(root: Path) -> list[Path]:
    """The iter_* checkpoint directories of `root` (symlinks out of it are not among them)."""
    return [p for p in root.glob("iter_*") if _ITERATION.fullmatch(p.name) and p.is_dir() and _inside(root, p)]


def has_checkpoint(path: str | Path) -> bool:
    """Whether `path` holds a checkpoint `resolve_checkpoint` would look for: a `latest` file
    (a --save directory) or an iter_* checkpoint itself. A save interrupted before its first
    checkpoint completed leaves only a `.partial` directory: no checkpoint."""
    path = Path(path)
    return (path / LATEST).exists() or ((path / STATE).exists() and (path / ".metadata").exists())


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory `path` names: a --save directory (its `latest`) or an iter_* dir.
    No verification: `select_checkpoint` is what loading uses."""
    path = Path(path)
    _check_exists(path)
    if (path / LATEST).exists():
        target, damaged = latest_target(path)
        if target is None:
            raise CheckpointError(f"{damaged}. Fix: write the name of one of its iter_* checkpoints into it, or delete "
                                  "it (a --load of the directory then resumes from the newest intact checkpoint)")
        if not (target / STATE).exists():
            raise CheckpointError(f"{path / LATEST} names {target.name}, which is missing or incomplete")
        return target
    if (path / STATE).exists() and (path / ".metadata").exists():
        return path
    raise _holds_nothing(path)


def _check_exists(path: Path) -> None:
    if not path.exists():
        raise CheckpointError(f"--load {path} does not exist. Fix: point it at a --save directory of an earlier run")


def _holds_nothing(path: Path) -> CheckpointError:
    return CheckpointError(
        f"--load {path} holds no checkpoint (no '{LATEST}' file and no iter_* checkpoint). "
        "Fix: point it at the --save directory of an earlier run"
    )


def _first_problems(verdict: Verdict) -> str:
    more = len(verdict.problems) - 1
    return verdict.problems[0] + (f" (and {more} more damaged file{'s' * (more > 1)})" if more else "")


def select_checkpoint(path: str | Path, contents: bool = True, group=None) -> tuple[Path, list[str]]:
    """The checkpoint to load for `--load path`, verified against its manifest, and the notices
    to print. A --save directory falls back from a damaged `latest` to the newest intact iter_*
    (the notice says which file was damaged); an explicit iter_* path never falls back: a damaged
    one is an error naming the file. `contents=False` checks presence and sizes only (cheap, no
    process group needed); with `contents` the CRC-32s too, collectively when a group is up."""
    path = Path(path)
    _check_exists(path)
    if not (path / LATEST).exists():
        if not any((path / name).exists() for name in (STATE, ".metadata", MANIFEST)):
            raise _holds_nothing(path)
        verdict = verify_checkpoint(path, contents, group)
        if not verdict.intact:
            raise CheckpointError(
                f"--load {path} is damaged: {_first_problems(verdict)}. An explicit checkpoint path never falls back. "
                f"Fix: restore that file, or pass the --save directory ({path.parent}) to resume from its newest intact "
                "checkpoint"
            )
        return path, []
    latest, damaged = latest_target(path)
    older = sorted((p for p in iterations(path) if latest is None or p.name != latest.name), reverse=True)
    rejected: list[Verdict] = []
    for candidate in [latest, *older] if latest is not None else older:
        verdict = verify_checkpoint(candidate, contents, group)
        if verdict.intact:
            notes = [f"CHECKPOINT {bad.checkpoint.name} IS DAMAGED: {_first_problems(bad)}; skipped" for bad in rejected]
            if damaged:
                notes.insert(0, f"{damaged}: skipped")
            if rejected or damaged:
                notes.append(f"falling back to {candidate.name}, the newest intact checkpoint in {path}: the steps after "
                             "it are trained again")
            return candidate, notes
        rejected.append(verdict)
    if damaged:
        rejected.insert(0, Verdict(path / LATEST, [damaged], ""))
    lines = "\n".join(f"  {bad.checkpoint.name}: {_first_problems(bad)}" for bad in rejected)
    raise CheckpointError(f"--load {path}: no intact checkpoint there:\n{lines}\n"
                          "Fix: restore the damaged files from a copy, or start without --load")


def read_state(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's state.json."""
    state = json.loads((checkpoint / STATE).read_text())
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{checkpoint} is not a {FORMAT} checkpoint (format {state.get('format')!r})")
    return state


# --dist-ckpt-strictness (Megatron's values): which key mismatches stop a load, and which are logged
# (a key in the checkpoint and not in the model is never read; one in the model and not in the
# checkpoint keeps its initialized value). A shape mismatch always stops it.
RAISES_UNEXPECTED = {"raise_unexpected", "raise_all"}
RAISES_MISSING = {"raise_all", "raise_unexpected", "log_unexpected", "assume_ok_unexpected", "return_unexpected"}
LOGS = {"log_unexpected", "log_all"}


def _check_shapes(checkpoint: Path, model_state: dict[str, torch.Tensor], pipeline_group=None,
                  strictness: str = "raise_all", copies: set[str] = frozenset()) -> tuple[list[str], list[str]]:
    """Raises CheckpointError for a shape mismatch and for the key mismatches `strictness` does
    not allow; logs those it allows under log_*; returns (this rank's model keys the checkpoint
    lacks, those of every pipeline stage): allowed only by log_all, return_all and ignore_all."""
    saved = {
        key.removeprefix("model."): tuple(meta.size)
        for key, meta in read_dcp_metadata(checkpoint).state_dict_metadata.items()
        if key.startswith("model.") and hasattr(meta, "size")
    }
    current = {key: tuple(value.shape) for key, value in model_state.items()}
    if pipeline_group is not None:  # each stage holds part of the model: compare the union
        stages = gather_objects((current, sorted(copies)), pipeline_group)
        current = {key: shape for stage, _ in stages for key, shape in stage.items()}
        copies = {key for _, names in stages for key in names}
    # a tied weight's copies are read from the weight: a checkpoint may hold them (written before) or not
    all_missing = sorted(set(current) - set(saved) - set(copies))
    all_unexpected = sorted(set(saved) - set(current))
    different = sorted(k for k in set(saved) & set(current) if saved[k] != current[k])
    missing = all_missing if strictness in RAISES_MISSING else []
    unexpected = all_unexpected if strictness in RAISES_UNEXPECTED else []
    if missing or unexpected or different:
        lines = [f"{checkpoint} was saved from a different model:"]
        for names, describe in (
            (different, lambda k: f"checkpoint {saved[k]} vs model {current[k]}"),
            (missing, lambda k: "in the model, not in the checkpoint"),
            (unexpected, lambda k: "in the checkpoint, not in the model"),
        ):
            lines += [f"  {k}: {describe(k)}" for k in names[:20]]
            if len(names) > 20:
                lines.append(f"  ... and {len(names) - 20} more like these")
        lines.append("Fix: build the model with the checkpoint's configuration (its state.json), or load another "
                     "checkpoint" + ("" if different else "; --dist-ckpt-strictness log_all loads the keys both hold"))
        raise CheckpointError("\n".join(lines))
    if strictness in LOGS and (all_unexpected or (all_missing and strictness == "log_all")):
        logger = logging.getLogger("dtmega.checkpoint")
        if all_unexpected:
            logger.warning("--dist-ckpt-strictness %s: %d key(s) of %s are not in the model and were not read: %s",
                           strictness, len(all_unexpected), checkpoint, ", ".join(all_unexpected[:20]))
        if all_missing:
            logger.warning("--dist-ckpt-strictness log_all: %d model key(s) are not in %s and keep their initialized "
                           "values: %s", len(all_missing), checkpoint, ", ".join(all_missing[:20]))
    return sorted(set(model_state) - set(saved) - set(copies)), all_missing


def _load_rng(path: Path) -> dict[str, Any]:
    """A rank's saved RNG states, unpickled with `weights_only`: a checkpoint is data, and
    opening one from someone else must not run their code."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{path} holds more than RNG state tensors (refused by weights_only loading: "
            f"{str(error).splitlines()[0]}). Fix: load a checkpoint written by dtmega, or delete that file "
            "to resume with fresh random states"
        ) from None


def load_runtime_state(path: str | Path, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The saved run-time state of the keys in `template` that the checkpoint holds (a
    checkpoint written without FP8 holds none of FP8's: those start fresh)."""
    checkpoint = resolve_checkpoint(path)
    saved = set(read_dcp_metadata(checkpoint).state_dict_metadata)
    present = {key: value.clone() for key, value in template.items() if f"runtime.{key}" in saved}
    if present:
        shards = {"runtime": present}
        load_dcp(shards, checkpoint)
        present = shards["runtime"]
    return present


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
    restore_rng: bool = True, pipeline_group=None, strictness: str = "raise_all",
) -> dict[str, Any]:
    """Loads `path` into `model` (and `optimizer`), resharding to the current plan; returns the
    saved state. Shapes are checked first, so a mismatch fails on every rank before any I/O.
    Under pipeline parallelism `model` holds this rank's stages; pass the `pipeline_group`.
    `strictness` is Megatron's --dist-ckpt-strictness (RAISES_UNEXPECTED, RAISES_MISSING above)."""
    checkpoint = resolve_checkpoint(path)
    state = read_state(checkpoint)
    shards: dict[str, Any] = {"model": get_model_state_dict(model)}
    copies = tied_copies(model, shards["model"])
    missing, every_stage_missing = _check_shapes(checkpoint, shards["model"], pipeline_group, strictness, set(copies))
    if every_stage_missing and optimizer is not None:  # the same on every rank: no rank goes on alone
        raise CheckpointError(f"{checkpoint} lacks {len(every_stage_missing)} of the model's weights (e.g. "
                              f"{every_stage_missing[0]}), so it has "
                              "no optimizer state for them. Fix: add --no-load-optim (a fresh optimizer) or "
                              "--finetune to load the weights it holds")
    for key in missing:  # not read: these keep their initialized values
        del shards["model"][key]
    if optimizer is not None:
        shards["optimizer"] = get_optimizer_state_dict(model, optimizer, options=OPTIMIZER_OPTIONS)
    # a tied weight's copies are read from the weight (checkpoints hold it once; tied_state.py)
    plans = {name: read_copies_as_their_weights(shards[name], copies) for name in shards}
    load_dcp(shards, checkpoint)
    for name, plan in plans.items():
        fill_copies(shards[name], plan)
    set_model_state_dict(model, shards["model"], options=StateDictOptions(strict=not missing))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, shards["optimizer"], options=OPTIMIZER_OPTIONS)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng_file = checkpoint / f"rng_rank{rank:05d}.pt"
    if restore_rng and state.get("world_size") == world and rng_file.exists():
        rng = _load_rng(rng_file)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return state
