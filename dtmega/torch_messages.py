"""Torch's own console messages moved into a file while dtmega compiles: Dynamo's graph-break and
"won't convert" tracebacks (hundreds of lines per frame under tensor parallelism), inductor's
warnings and the Python warnings torch raises meanwhile. The user's console keeps dtmega's short
summary, which names the file; the details stay readable there.

    messages = TorchMessagesToFile(default_log_path("capture_step"))
    with messages:              # torch's console handlers point at the file, warnings too
        compiled(batch)
    messages.written            # True once torch wrote anything

Only the console handlers on torch's loggers (`torch`, `torch.*`; plain `StreamHandler`s, which
torch installs on each) are swapped, and only while the block runs; file handlers (one's own, a
`TORCH_TRACE` directory) are left alone. Entering is cheap (a few list assignments, the scan of
torch's loggers is kept), because a step enters it on every call: a recompile may log at any step.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from pathlib import Path

import torch


def default_log_path(what: str) -> Path:
    """`<temp dir>/dtmega/<what>-<pid>-rank<rank>.log`: one file per process, so ranks never write
    into each other's file (the rank is the global one, 0 without torch.distributed)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
    return Path(tempfile.gettempdir()) / "dtmega" / f"{what}-{os.getpid()}-rank{rank}.log"


def _console_handlers() -> list[tuple[logging.Logger, int, logging.Handler]]:
    """(logger, index, handler) for every console handler on torch's loggers: handlers of exactly
    `logging.StreamHandler`, what torch installs on each of its loggers for the console (a
    `FileHandler` or torch's `TORCH_TRACE` handler is a subclass, and stays)."""
    found = []
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if (name == "torch" or name.startswith("torch.")) and isinstance(logger, logging.Logger):
            for index, handler in enumerate(logger.handlers):
                if type(handler) is logging.StreamHandler:
                    found.append((logger, index, handler))
    return found


class TorchMessagesToFile:
    """A reusable context manager: inside it torch's console log handlers and Python's warnings
    write to `path` (appended; its folder is created); outside, everything is as it was."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = logging.FileHandler(self.path, mode="a", encoding="utf-8", delay=True)
        self._file.setLevel(logging.DEBUG)
        self._consoles: list[tuple[logging.Logger, int, logging.Handler]] = []
        self._warnings: warnings.catch_warnings | None = None

    @property
    def written(self) -> bool:
        """True once anything was written to the file."""
        return self.path.exists() and self.path.stat().st_size > 0

    def __enter__(self) -> "TorchMessagesToFile":
        if not self._consoles or any(logger.handlers[index:index + 1] != [handler]
                                     for logger, index, handler in self._consoles):
            self._consoles = _console_handlers()  # first use, or torch's logging was set up again
            if self._consoles and self._file.formatter is None:
                self._file.setFormatter(self._consoles[0][2].formatter)  # torch's own line prefix
        for logger, index, _ in self._consoles:
            logger.handlers[index] = self._file  # in place: logging reads the list without a lock
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.showwarning = self._show_warning
        return self

    def __exit__(self, *exc) -> None:
        self._warnings.__exit__(*exc)
        self._warnings = None
        for logger, index, handler in self._consoles:
            if logger.handlers[index:index + 1] == [self._file]:
                logger.handlers[index] = handler
        self._file.flush()

    def _show_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        text = warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n")
        self._file.handle(logging.LogRecord("py.warnings", logging.WARNING, filename, lineno, text, None, None))

    def close(self) -> None:
        """Closes the file (a later `with` reopens it)."""
        self._file.close()
