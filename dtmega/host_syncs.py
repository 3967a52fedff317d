"""Finding host synchronizations: the ops that make the host wait for the device's result.

`.item()`, `float(t)`, `bool(t)` and `if t:` read a value back (`aten._local_scalar_dense`,
`aten.is_nonzero`); `nonzero`, `masked_select`, `unique` and boolean indexing must learn their
output's size from the data; `equal` answers on the host. On a GPU each stalls the CPU until the
queue drains, and none can be captured in a CUDA graph. `HostSyncs` records every such op run
under it, with the first frame of dtmega's code that called it, on any device: the CPU suite
shows with it that a step has none (tests/distributed/test_fp8_host_syncs.py), where
`torch.cuda.set_sync_debug_mode` would need a GPU.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING = frozenset({
    "aten._local_scalar_dense", "aten.is_nonzero", "aten.nonzero", "aten.masked_select", "aten.equal",
    "aten._unique", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive", "aten.repeat_interleave",
    "aten.nonzero_static",
})
BOOLEAN_INDEXING = frozenset({"aten.index", "aten.index_put", "aten.index_put_"})  # x[mask]: sized by the mask


def _masked(args) -> bool:
    """Whether an indexing op's indices hold a boolean mask (its result's size depends on it)."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(getattr(index, "dtype", None) == torch.bool for index in indices)


@dataclass
class HostSync:
    """One synchronizing op and where dtmega's code called it ('file.py:line in function')."""

    op: str
    where: str


@dataclass
class HostSyncs(TorchDispatchMode):
    """Records synchronizing ops (see the module docstring) while active."""

    found: list[HostSync] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        name = name if name.startswith("aten.") else f"aten.{name}"
        if name in SYNCING and not (name == "aten.repeat_interleave" and "output_size" in (kwargs or {})) \
                or name in BOOLEAN_INDEXING and _masked(args):
            self.found.append(HostSync(name, _caller()))
        return func(*args, **(kwargs or {}))

    def describe(self) -> str:
        """'none', or each op with where it was called."""
        return "none" if not self.found else "; ".join(f"{s.op} at {s.where}" for s in self.found)


def _own_folders() -> tuple[Path, ...]:
    """dtmega's packages on disk (in a checkout `passes/` and `kernels/` sit beside `dtmega/`)."""
    import dtmega.kernels
    import dtmega.passes

    return tuple(Path(module.__file__).resolve().parent for module in (dtmega.kernels, dtmega.passes)) + \
        (Path(__file__).resolve().parent,)


def _caller() -> str:
    """The innermost frame of dtmega's own code on the stack (else the innermost frame)."""
    frames = traceback.extract_stack()[:-3]
    folders = _own_folders()
    for frame in reversed(frames):
        path = Path(frame.filename).resolve()
        for folder in folders:
            if folder in path.parents and path.name != "host_syncs.py":
                return f"{folder.name}/{path.relative_to(folder)}:{frame.lineno} in {frame.name}"
    last = frames[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"


def syncs_of(run, *args, **kwargs) -> list[HostSync]:
    """The host synchronizations `run(*args, **kwargs)` makes."""
    with HostSyncs() as recorder:
        run(*args, **kwargs)
    return recorder.found
