"""The console every dtmega command, example and benchmark prints through.

One rank prints (rank 0 of the launched job) unless `DTMEGA_PRINT_ALL_RANKS=1`; tables are as
wide as the terminal, or `COLUMNS` (default 200) when the output is a log file or a CI console,
where rich would otherwise wrap every table at 80 columns.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

LOG_WIDTH = 200


def is_leader() -> bool:
    """True on the rank that prints: rank 0 of the process group (or of the torchrun launch
    before the group exists), or every rank when DTMEGA_PRINT_ALL_RANKS=1."""
    if os.environ.get("DTMEGA_PRINT_ALL_RANKS") == "1":
        return True
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def console(*, leader: bool | None = None, stderr: bool = False) -> Console:
    """A rich Console that is quiet except on the printing rank (`leader`, default `is_leader()`)
    and does not wrap tables at 80 columns when writing to a file or pipe."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or "COLUMNS" in os.environ else LOG_WIDTH
    return Console(quiet=not (is_leader() if leader is None else leader), width=width, stderr=stderr)
