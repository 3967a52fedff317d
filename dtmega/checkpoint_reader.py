"""Reading torch.distributed.checkpoint (DCP) directories as data, never as code.

torch's own `FileSystemReader` unpickles `.metadata` with `pickle.load`, and its default load
planner reads every "bytes" entry (optimizer param-group values, ...) with
`torch.load(weights_only=False)`: a checkpoint from someone else could run their code on load,
whatever its checksums say (a forger rewrites them too). Every DCP read in dtmega goes through
this module instead (tests/unit/test_layers.py checks that no other module calls `dcp.load` or
`FileSystemReader`):

- `.metadata` is unpickled by a restricted unpickler that admits only the classes DCP itself
  writes there (its metadata dataclasses, `torch.Size`, dtypes, layouts, memory formats,
  `pathlib` paths) and plain Python values; anything else is refused with the file named.
- bytes entries are read with `torch.load(weights_only=True)`: numbers, strings, tuples, lists,
  dicts and tensors; anything else is refused with the file and key named.
- every file `.metadata` points at must be a plain file name inside the checkpoint directory
  and a regular file there (not a symlink, a device or a path elsewhere): a planted
  `/dev/zero` or `../other/__0_0.distcp` is refused before any read.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from dtmega.kernels.errors import DtmegaError

METADATA = ".metadata"

# What DCP's own writers put into `.metadata` (torch 2.11-2.13, megatron-core's torch_dist):
# module -> names admitted.
_ADMITTED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    # megatron-core's torch_dist checkpoints also keep every rank's save plan (`all_local_plans`)
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}


class UnsafeCheckpointError(DtmegaError):
    """A checkpoint file holds more than data, or points outside its directory: refused unread."""


def _refusal(path: Path | str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path}: {what}. A checkpoint is loaded as data only; this file was not used and nothing in it ran. "
        "Fix: load a checkpoint written by dtmega or torch.distributed.checkpoint from a source you trust, "
        "or restore this file from your own copy"
    )


class _DataOnlyUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: the admitted classes and plain values, nothing callable else."""

    def __init__(self, handle: io.BufferedIOBase, path: Path):
        super().__init__(handle)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ADMITTED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise _refusal(self.path, f"its pickle asks for {module}.{name}, which is not checkpoint metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise _refusal(self.path, "its pickle holds a persistent reference, which checkpoint metadata never does")


def read_dcp_metadata(checkpoint: str | Path) -> Metadata:
    """The DCP `Metadata` of the checkpoint directory `checkpoint`, read as data only (see the
    module's docstring); its storage entries are checked to stay inside the directory."""
    return SafeFileSystemReader(checkpoint).read_metadata()


_PLAIN_NAME = re.compile(r"^[^/\\\x00]+$")


def is_file_name(name: str) -> bool:
    """Whether `name`, read from a checkpoint's own files, is a bare file name: never a path,
    never `.` or `..` (what keeps every name a checkpoint gives inside its directory)."""
    return bool(_PLAIN_NAME.match(name)) and name not in (".", "..")


def check_inside(checkpoint: Path, name: str, named_by: Path) -> Path:
    """`checkpoint / name` when `name` (read from the file `named_by`) is a plain file name and a
    regular file there; otherwise an UnsafeCheckpointError. Follows no symlink: a link to a file
    elsewhere, an absolute path, `..`, a device or a FIFO are refused before any read."""
    if not is_file_name(name):
        raise _refusal(named_by, f"it names {name!r}, which is not a file inside {checkpoint}")
    path = checkpoint / name
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise _refusal(named_by, f"it names {name!r}, which is missing from {checkpoint}") from None
    if not stat.S_ISREG(mode):
        kind = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
        raise _refusal(named_by, f"it names {path}, which is {kind}")
    return path


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader with `.metadata` unpickled as data, every file it names confined
    to the checkpoint directory, and bytes entries read with `weights_only`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata through the restricted unpickler; its storage entries checked."""
        rank = kwargs.get("rank")
        directory = Path(self.path)
        path = Path(self._get_metadata_path(rank))
        if not path.is_file():
            raise UnsafeCheckpointError(f"{directory} has no {path.name}: not a torch.distributed.checkpoint "
                                        "directory. Fix: point at an iter_* checkpoint or the --save directory")
        check_inside(directory, path.name, directory)
        with open(path, "rb") as handle:
            try:
                metadata = _DataOnlyUnpickler(handle, path).load()
            except UnsafeCheckpointError:
                raise
            except Exception as error:  # a truncated or garbage pickle: damaged, not dangerous
                raise UnsafeCheckpointError(f"{path} is damaged ({type(error).__name__}: {error}). Fix: restore it "
                                            "from a copy, or load another checkpoint") from None
        if not isinstance(metadata, Metadata):
            raise _refusal(path, f"it holds a {type(metadata).__name__}, not DCP Metadata")
        for info in (metadata.storage_data or {}).values():
            check_inside(directory, str(getattr(info, "relative_path", "")), path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        """torch's read, with every bytes entry refused unless `weights_only` loading admits it."""
        return super().read_data(plan, _DataOnlyBytes(planner, self))


class _DataOnlyBytes:
    """The load planner as the reader sees it, with bytes entries read as data only."""

    def __init__(self, planner: Any, reader: SafeFileSystemReader):
        self._planner = planner
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Checks the entry loads under weights_only, then hands the planner data-only bytes."""
        try:
            torch.load(value, weights_only=True)
        except Exception as error:
            file = Path(self._reader.path) / self._reader.storage_data[read_item.storage_index].relative_path
            raise _refusal(file, f"its entry {read_item.dest_index.fqn!r} is not plain data (weights_only "
                                 f"loading refused it: {_why(error)})") from None
        value.seek(0)
        self._planner.load_bytes(read_item, value)


class DataOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with bytes entries unpickled by `weights_only` loading."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """As DefaultLoadPlanner.load_bytes, without unpickling code."""
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _why(error: Exception) -> str:
    """The line of torch's weights_only refusal that says what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line or "unsupported" in line]
    return ((named or lines or [type(error).__name__])[0])[:240]


def load_dcp(state: dict[str, Any], checkpoint: str | Path, *, no_dist: bool = False) -> None:
    """`dcp.load(state, ...)` of the checkpoint directory `checkpoint`, as data only. DCP wraps
    a reader's error in a CheckpointException gathered from every rank (so no rank waits on
    another): the first of dtmega's own errors in it is raised as itself, on every rank."""
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(checkpoint)), planner=DataOnlyLoadPlanner(),
                 no_dist=no_dist)
    except CheckpointException as wrapped:
        for _, (error, _trace) in sorted(wrapped.failures.items()):
            if isinstance(error, DtmegaError):
                raise error from None
        raise
