"""TOML in and out for plans and layouts: text or a .toml path, errors as PlanError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli_w
import tomllib

from dtmega.kernels.errors import MissingInput
from dtmega.passes.errors import PlanError


def dump_toml(data: dict[str, Any], path: str | Path | None = None) -> str:
    """TOML text of `data`; also written to `path` if given."""
    text = tomli_w.dumps(data)
    if path is not None:
        Path(path).write_text(text)
    return text


def load_toml(source: str | Path) -> dict[str, Any]:
    """Parses TOML given inline or as a path to a .toml file."""
    if isinstance(source, Path) or ("\n" not in source and source.endswith(".toml")):
        path = Path(source)
        if not path.exists():
            raise MissingInput(f"{path} does not exist")
        source = path.read_text()
    try:
        return tomllib.loads(source)
    except tomllib.TOMLDecodeError as error:
        raise PlanError(f"not valid TOML: {error}") from error
