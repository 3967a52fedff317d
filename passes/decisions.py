"""Who decided what in the layout, and the refusal of a pass that silently replaces another's decision.

The `PassManager` reads every decision of the layout before and after each pass's `annotate`:
a decision no pass had made is recorded as the current pass's; one another pass made and the
current pass changed is refused, naming both passes and the module, unless the current pass
declares that it refines the other's layout (`Pass.refines`: `SequenceParallel` turns the
all-reduces `TensorParallel` wrote into reduce-scatters). A pass that wants to fill only what
nobody decided reads `program.decided_by(fqn, field)` (`DataParallel` keeps the units another
pass chose). Issue 47: `DataParallel` used to overwrite another pass's `wrap` with no error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from dtmega.passes.errors import PlanError

if TYPE_CHECKING:
    from dtmega.passes.base import Pass
    from dtmega.passes.layout import Layout

# ModuleLayout fields holding one decision, and those holding one per key (per mesh axis, option)
SINGLE_FIELDS = ("style", "stage", "virtual_stage", "recompute", "kernel", "compiled", "precision", "wrap")
KEYED_FIELDS = ("inputs", "outputs", "options")

Key = tuple[str, str]  # (module FQN, decision: "kernel", "inputs[tp]", "params.weight[dp_shard]")


def decisions_of(layout: "Layout") -> dict[Key, Any]:
    """Every decision the layout holds: one per single field that is set, one per key of the
    keyed fields, one per parameter and mesh axis a placement was written for."""
    found: dict[Key, Any] = {}
    for fqn, entry in layout.modules.items():
        for name in SINGLE_FIELDS:
            value = getattr(entry, name)
            if value is not None:
                found[(fqn, name)] = value
        for name in KEYED_FIELDS:
            for key, value in getattr(entry, name).items():
                found[(fqn, f"{name}[{key}]")] = value
        for param, placement in entry.params.items():
            for axis, value in placement.placements.items():
                found[(fqn, f"params.{param}[{axis}]")] = value
    return found


@dataclass
class Decisions:
    """The layout's decisions with the pass that made each (filled by the PassManager)."""

    owners: dict[Key, str] = field(default_factory=dict)
    provided: dict[str, tuple[str, ...]] = field(default_factory=dict)  # pass name -> its capabilities

    def decided_by(self, fqn: str, name: str) -> str | None:
        """The pass that wrote decision `name` ("wrap", "kernel", "inputs[tp]") of module `fqn`, or None."""
        return self.owners.get((fqn, name))

    def record(self, before: dict[Key, Any], after: dict[Key, Any], current: "Pass") -> None:
        """Records the decisions `current` added; PlanError if it changed or removed one another
        pass made and does not declare that it refines that pass's layout."""
        self.provided[current.name] = current.provided()
        refined = current.refined()
        for key, old in before.items():
            new = after.get(key)
            owner = self.owners.get(key)
            if new == old or owner is None or owner == current.name:
                continue
            if any(fnmatchcase(what, pattern) for pattern in refined
                   for what in (*self.provided.get(owner, ()), owner)):
                self.owners[key] = current.name
                continue
            fqn, name = key
            what = f"to {new!r}" if key in after else "away"
            raise PlanError(
                f"{current.name} changes {fqn or '<root>'}.{name} from {old!r} {what}, which {owner} decided: a pass "
                f"must not silently replace another's decision. Fix: drop one of {owner} and {current.name} (or "
                f"restrict one to other modules), make {current.name} leave what another pass decided alone "
                f"(program.decided_by), or, if {current.name} refines {owner}'s layout, declare it: "
                f"refines = {self._refines_hint(owner)!r} on {current.name}"
            )
        for key, new in after.items():
            if key not in before or before[key] != new:
                self.owners[key] = current.name

    def _refines_hint(self, owner: str) -> tuple[str, ...]:
        return self.provided.get(owner) or (owner,)
