"""Rich rendering of a layout: one row per module (repeated blocks folded into one row)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from rich.table import Table

if TYPE_CHECKING:
    from dtmega.passes.layout import Layout, ModuleLayout

_INDEX = re.compile(r"(?:(?<=\.)|^)\d+(?=\.|$)")


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _axes_text(placements: dict[str, str]) -> str:
    return " ".join(f"{axis}:{p}" for axis, p in placements.items()) or "R"


def _params_text(entry: "ModuleLayout") -> str:
    lines = []
    for name, param in entry.params.items():
        if param.tied_to:
            lines.append(f"{name} = {param.tied_to}")
        else:
            lines.append(f"{name} {_axes_text(param.placements)}")
    return "\n".join(lines)


def _is_interesting(entry: "ModuleLayout") -> bool:
    return bool(entry.params or entry.style or entry.recompute or entry.wrap or entry.kernel or entry.compiled)


def layout_table(layout: "Layout", *, fold: bool = True, title: str | None = None) -> Table:
    """A table of the layout. With `fold`, blocks that differ only in their index share a row."""
    columns = ("module", "type", "parameters (per-axis placements)", "inputs", "outputs",
               "stage", "recompute", "kernel", "precision", "bytes/rank")
    rows = []
    groups: dict[tuple[str, str], list[str]] = {}
    as_data = layout.to_dict()["modules"]
    for fqn, entry in layout.modules.items():
        if not _is_interesting(entry):
            continue
        key_fqn = _INDEX.sub("*", fqn) if fold else fqn
        signature = repr({k: v for k, v in as_data[fqn].items() if k != "params"}) + _params_text(entry)
        groups.setdefault((key_fqn, signature), []).append(fqn)
    for (pattern, _), members in groups.items():
        entry = layout.modules[members[0]]
        name = pattern or "<root>"
        if len(members) > 1:
            name = f"{name}  (x{len(members)})"
        stage = "" if entry.stage is None else str(entry.stage)
        if entry.virtual_stage is not None:
            stage += f" (v{entry.virtual_stage})"
        rows.append((
            name, entry.type, _params_text(entry), _axes_text(entry.inputs) if entry.inputs else "",
            _axes_text(entry.outputs) if entry.outputs else "", stage, entry.recompute or "",
            " ".join(filter(None, (entry.kernel, f"compiled({entry.compiled})" if entry.compiled else None))),
            str(entry.precision or ""), human_bytes(layout.entry_bytes(entry)),
        ))
    # Columns no entry uses (e.g. stage before pipelining) are left out to keep the table narrow.
    keep = [i for i, column in enumerate(columns) if i < 2 or column == "bytes/rank" or any(row[i] for row in rows)]
    table = Table(title=title or f"layout on mesh {layout.mesh}")
    for i in keep:
        table.add_column(columns[i], overflow="fold")
    for row in rows:
        table.add_row(*(row[i] for i in keep))
    total = layout.local_bytes()
    table.caption = (
        f"{layout.local_param_count():,} of {layout.global_param_count():,} parameters on rank 0 "
        f"({human_bytes(total)})"
    )
    return table
