"""The custom-plan section of `dtmega train`'s arguments: passes of one's own beside the flags' (plan_file.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtmega.passes.toml_io import dump_toml
from dtmega.train.arg_fields import ArgumentError
from dtmega.train.arg_fields import opt as _opt
from dtmega.train.plan_file import CustomPlan, read_plan_file


@dataclass(frozen=True)
class PlanArgs:
    """Passes of one's own (`--plan FILE`, or `[[passes]]` tables in `--config`), added to the passes the flags build."""

    plan: str | None = _opt(None, "a TOML file of [[passes]] tables (pass = \"ClassName\" and its fields; module = "
                                  "\"my.module\" is imported first; replaces = \"TensorParallel\" runs it instead of "
                                  "that flag-built pass), added to the passes the flags build where their provides/"
                                  "requires/after put them (docs/writing-a-pass.md); --config's [[passes]] are held "
                                  "here as their TOML text")

    def custom_plan(self) -> CustomPlan | None:
        """The passes of --plan (or of --config's [[passes]]), their modules imported; None without them."""
        return read_plan_file(self.plan) if self.plan else None


def config_passes(values: dict[str, Any], config: Path, command_line: dict[str, Any]) -> dict[str, Any]:
    """`--config` options with its `[[passes]]` tables moved into the `plan` option (as their
    TOML text), so a config file carries its passes as a --plan file does. Both a config's
    passes and a plan file (the config's `plan` key, or --plan) are refused: which one runs
    would otherwise be decided silently."""
    if "passes" not in values:
        return values
    elsewhere = "its plan key" if "plan" in values else "--plan" if "plan" in command_line else None
    if elsewhere:
        raise ArgumentError(f"{config}: [[passes]] tables and {elsewhere} both give passes of your own. Fix: keep one "
                            "of them (a plan file's tables can move into the config, or the reverse)")
    values = dict(values)
    passes = values.pop("passes")
    if not isinstance(passes, list) or not all(isinstance(table, dict) for table in passes):
        raise ArgumentError(f"{config}: passes = {passes!r}; passes are [[passes]] tables. Fix: one [[passes]] table "
                            "per pass, with pass = \"ClassName\" and its fields")
    values["plan"] = dump_toml({"passes": passes})
    return values
