"""A checksum per checkpoint file, written at save and verified at load.

`manifest.json` in every `iter_*` checkpoint lists each file with its size and CRC-32. CRC-32
(zlib's, 3.6 GiB/s on one core of a 2-core AVX2 CPU, against 1.5 for SHA-256 and 0.7 for
BLAKE2b) catches what happens to checkpoints in practice: a truncated or deleted shard, flipped
bits, a half-copied directory. It is not a defence against someone forging a file on purpose;
that is what data-only loading is for (dtmega/checkpoint_reader.py: nothing in a checkpoint is
unpickled as code) and what confining every name the manifest lists to the checkpoint is for.

Costs are spread over the ranks: at save each rank hashes the shards it wrote itself (just
written, so usually read back from the page cache) and rank 0 writes the manifest; at load the
files are dealt out round-robin, so the job reads the checkpoint once more in total, not once
per rank. docs/reliability.md has the measured costs.
"""

from __future__ import annotations

import json
import os
import re
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from dtmega.checkpoint_reader import is_file_name
from dtmega.mesh import gather_objects
from dtmega.safe_files import write_file_exclusive

MANIFEST = "manifest.json"
ALGORITHM = "crc32"
_CHUNK = 8 << 20


def file_checksum(path: Path) -> tuple[int, str]:
    """(size in bytes, CRC-32 as 8 hex digits) of the file at `path`, read in 8 MiB chunks."""
    crc, size = 0, 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"{crc:08x}"


LOCAL = "local"  # as `group`: this process checks alone, with no collective (a subset of the ranks)


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_initialized() or group == LOCAL:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _gather(value, group) -> list:
    return [value] if group == LOCAL else gather_objects(value, group)


def _union(problems: list[str], group) -> list[str]:
    return sorted({problem for part in _gather(problems, group) for problem in part})


def own_files(directory: Path, rank: int) -> list[str]:
    """The files of a checkpoint in progress that `rank` wrote: its DCP shards
    (`__<rank>_<n>.distcp`, FileSystemWriter's naming) and its RNG states."""
    shard = re.compile(rf"__{rank}_\d+\.distcp$")
    names = [p.name for p in directory.iterdir() if shard.match(p.name)]
    return sorted(names + [f"rng_rank{rank:05d}.pt"])


def write_manifest(directory: Path, leader_files: list[str], group=None) -> None:
    """Collective: every rank checksums the files it wrote into `directory`; rank 0 also the
    `leader_files` (`.metadata`, state.json, ...) and writes `manifest.json`."""
    rank, _ = _rank_world(group)  # the world's rank: DCP names shards by it
    names = own_files(directory, rank) + (leader_files if rank == 0 else [])
    mine = {name: file_checksum(directory / name) for name in names if (directory / name).exists()}
    everyone = _gather(mine, group)
    if rank == 0:
        files = {name: {"size": size, ALGORITHM: digest}
                 for part in everyone for name, (size, digest) in sorted(part.items())}
        text = json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, indent=1)
        tmp = directory / f".{MANIFEST}.tmp"
        write_file_exclusive(tmp, text)
        os.replace(tmp, directory / MANIFEST)


@dataclass
class Verdict:
    """What verification found in one checkpoint: `problems` (one line each, naming the file)
    is empty when it is intact; `checked` says how (a checkpoint from before manifests can only
    be checked for its index file)."""

    checkpoint: Path
    problems: list[str]
    checked: str

    @property
    def intact(self) -> bool:
        return not self.problems


def _read_manifest(checkpoint: Path) -> dict | None:
    path = checkpoint / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("algorithm") != ALGORITHM or not isinstance(files, dict) or not all(
                isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get(ALGORITHM), str)
                for e in files.values()):
            raise ValueError
        return files
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return {}


def _without_manifest(checkpoint: Path) -> Verdict:
    """A checkpoint with no manifest: one written before manifests (its state.json does not
    promise one) is checked for its index and state files; one that lost its manifest is damaged."""
    state = checkpoint / "state.json"
    missing = [f"{checkpoint / name} is missing" for name in (".metadata", "state.json") if not (checkpoint / name).exists()]
    if not missing:
        try:
            promised = json.loads(state.read_text()).get("manifest")
        except (ValueError, UnicodeDecodeError, AttributeError):
            return Verdict(checkpoint, [f"{state} is damaged (not a JSON object)"], "no manifest")
        if promised:
            return Verdict(checkpoint, [f"{checkpoint / MANIFEST} is missing"], "no manifest")
    return Verdict(checkpoint, missing, "no manifest (written before checksums): index and state files only")


def verify_checkpoint(checkpoint: Path, contents: bool = True, group=None) -> Verdict:
    """Checks every file the manifest lists: present, of its size and (with `contents`) of its
    checksum. Collective over `group` (default: the world) when a process group is up: the files
    are dealt out over its ranks and every rank returns the same verdict; `group=LOCAL` checks
    everything in this process alone."""
    if not checkpoint.is_dir():
        return Verdict(checkpoint, [f"{checkpoint} is missing"], "")
    files = _read_manifest(checkpoint)
    if files is None:
        return _without_manifest(checkpoint)
    if not files:
        return Verdict(checkpoint, [f"{checkpoint / MANIFEST} is damaged (not a {ALGORITHM} manifest)"], "manifest")
    problems: list[str] = []
    for name, entry in files.items():
        path = checkpoint / name
        if not is_file_name(name):
            problems.append(f"{checkpoint / MANIFEST} names {name!r}, which is not a file inside {checkpoint} "
                            "(refused unread)")
        elif not os.path.lexists(path):
            problems.append(f"{path} is missing")
        elif not stat.S_ISREG(os.lstat(path).st_mode):
            problems.append(f"{path} is a symlink or not a regular file (refused unread: a checkpoint's files are "
                            "its own)")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{path} has {path.stat().st_size} bytes, but the manifest says {entry['size']} "
                            "(truncated or replaced)")
    problems = _union(problems, group)  # one verdict everywhere, and the same collectives after it
    if contents and not problems:
        rank, world = _rank_world(group)
        mine = [name for index, name in enumerate(sorted(files)) if index % world == rank]
        found = [f"{checkpoint / name} does not match its checksum (its bytes changed after the save)"
                 for name in mine if file_checksum(checkpoint / name)[1] != files[name][ALGORITHM]]
        problems = _union(found, group)
    return Verdict(checkpoint, problems, f"{len(files)} files, sizes" + (f" and {ALGORITHM}" if contents else ""))
