"""A plan: the ordered list of passes `parallelize` runs, readable and writable as TOML."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.toml_io import dump_toml, load_toml


class Plan:
    """An ordered sequence of passes, e.g. `Plan([TensorParallel(), DataParallel("fsdp")])`."""

    def __init__(self, passes: Sequence[Pass] = ()):
        passes = list(passes)
        for p in passes:
            if not isinstance(p, Pass):
                raise PlanError(
                    f"Plan takes pass instances, got {p!r}; e.g. Plan([TensorParallel(), DataParallel()])"
                )
        self.passes: list[Pass] = passes

    def __iter__(self) -> Iterator[Pass]:
        return iter(self.passes)

    def __len__(self) -> int:
        return len(self.passes)

    def __repr__(self) -> str:
        return f"Plan({self.passes!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self.to_dict() == other.to_dict()

    def to_dict(self) -> dict:
        """{"passes": [{"pass": "TensorParallel", ...}, ...]}."""
        return {"passes": [p.to_dict() for p in self.passes]}

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        """Inverse of `to_dict`."""
        if "passes" not in data:
            raise PlanError("a plan needs a 'passes' list ([[passes]] tables in TOML)")
        return cls([Pass.from_dict(entry) for entry in data["passes"]])

    def to_toml(self, path: str | Path | None = None) -> str:
        """TOML text of the plan; also written to `path` if given."""
        return dump_toml(self.to_dict(), path)

    @classmethod
    def from_toml(cls, source: str | Path) -> "Plan":
        """Reads a plan from TOML text or a .toml path."""
        return cls.from_dict(load_toml(source))
