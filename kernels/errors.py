"""The one base of dtmega's input errors (here, in the lowest layer, so that every layer can
raise them): a `DtmegaError` says what in the user's input is wrong and how to fix it. The
`dtmega` command prints one as a single line and exits 2; any other exception is a bug of ours
(or of a library) and keeps its traceback (exit 1)."""

from __future__ import annotations


class DtmegaError(ValueError):
    """Bad input (a flag, a file, a plan, a request), with the fix in the message."""


class MissingInput(DtmegaError, FileNotFoundError):
    """A file or directory the user named does not exist."""
