"""What every section of `dtmega train`'s arguments is made of: the error a bad argument raises
and the field helper that carries a flag's help and choices (args.py builds the parser from them)."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from dtmega.kernels.errors import DtmegaError


class ArgumentError(DtmegaError):
    """The arguments cannot run; the message names the flag and the fix."""


def opt(default: Any = None, help: str = "", choices: tuple | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """A section field for flag --<name>: its default, its `--help` line, its choices, and other
    spellings the flag is given in (Megatron's `--override-opt_param-scheduler`)."""
    meta = {"help": help, "choices": choices, "aliases": aliases}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)
