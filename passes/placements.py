"""Placements as the short strings the layout stores ("R", "S(0)", "P", "S(1)->R").

The layout is data (TOML, diffs, reports), so it holds text; passes turn the text into
torch `Placement` objects only when they materialize.
"""

from __future__ import annotations

import re

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from dtmega.passes.errors import PlanError

REPLICATE = "R"
PARTIAL = "P"

_SHARD = re.compile(r"^S\((-?\d+)\)$")


def shard(dim: int) -> str:
    """The layout string for sharding on tensor dim `dim`."""
    return f"S({dim})"


def shard_dim(text: str) -> int | None:
    """The tensor dim of a shard placement string, or None if it is not a shard."""
    match = _SHARD.match(text)
    return int(match.group(1)) if match else None


def to_placement(text: str) -> Placement:
    """Parses "R", "P", "P(sum)" or "S(d)" into a torch placement."""
    text = text.strip()
    if text == REPLICATE:
        return Replicate()
    if text in (PARTIAL, "P(sum)"):
        return Partial()
    dim = shard_dim(text)
    if dim is not None:
        return Shard(dim)
    raise PlanError(f"unknown placement {text!r}; use 'R', 'P' or 'S(<dim>)'")


def transition(text: str) -> tuple[str, str]:
    """Splits "src->dst" (a redistribution) into its ends; a lone placement is both ends."""
    if "->" in text:
        src, dst = (part.strip() for part in text.split("->", 1))
        return src, dst
    return text, text
