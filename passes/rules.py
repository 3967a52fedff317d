"""Rules: which modules get which style, by FQN glob and optionally by module type.

Globs match dotted FQNs component by component: `*` matches one component (or part of one),
`**` matches any number of components. `layers.*.attention.wq` matches `layers.7.attention.wq`;
`**.w1` matches every `w1` at any depth.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from torch import nn

from dtmega.passes.errors import PlanError


@dataclass(frozen=True)
class Rule:
    """Give `style` to every module whose FQN matches `pattern` (and whose class, or a base
    class, is named `module_type` when given). `options` parameterize the style."""

    pattern: str
    style: str
    module_type: str | None = None
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)

    def matches(self, fqn: str, module: nn.Module) -> bool:
        """True if this rule applies to `module` at `fqn`."""
        if not _compile(self.pattern).fullmatch(fqn):
            return False
        if self.module_type is None:
            return True
        return any(cls.__name__ == self.module_type for cls in type(module).__mro__)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for TOML."""
        data: dict[str, Any] = {"pattern": self.pattern, "style": self.style}
        if self.module_type:
            data["module_type"] = self.module_type
        if self.options:
            data["options"] = dict(self.options)
        return data

    @classmethod
    def coerce(cls, value: "Rule | dict | tuple") -> "Rule":
        """Accepts a Rule, a {pattern, style, ...} dict, or a (pattern, style) pair."""
        if isinstance(value, Rule):
            return value
        if isinstance(value, dict):
            return cls(**value)
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return cls(pattern=value[0], style=value[1])
        raise PlanError(f"cannot read rule {value!r}; use Rule(pattern, style) or ('pattern', 'style')")


@lru_cache(maxsize=None)
def _compile(pattern: str) -> re.Pattern:
    components = pattern.split(".")
    regex = ""
    for i, component in enumerate(components):
        last = i == len(components) - 1
        if component == "**":
            if not last:
                regex += r"(?:[^.]+\.)*"
            elif i == 0:
                regex += r"(?:[^.]+(?:\.[^.]+)*)?"
            else:
                regex = regex.removesuffix(r"\.") + r"(?:\.[^.]+)*"
            continue
        piece = "".join(
            "[^.]*" if ch == "*" else "[^.]" if ch == "?" else re.escape(ch) for ch in component
        )
        regex += piece if last else piece + r"\."
    return re.compile(regex)


def glob_match(pattern: str, fqn: str) -> bool:
    """True if the dotted `fqn` matches the component-wise glob `pattern`."""
    return _compile(pattern).fullmatch(fqn) is not None


def resolve_rules(
    modules: dict[str, nn.Module], defaults: list[Rule], overrides: list[Rule]
) -> tuple[dict[str, Rule], list[Rule]]:
    """FQN -> winning rule, with user `overrides` beating `defaults` (later rules beat earlier
    ones within each list). Also returns the user rules that matched no module at all (a
    built-in rule set covers every variant of its family, e.g. dense and MoE blocks, so a
    built-in rule may match nothing in one model)."""
    chosen: dict[str, Rule] = {}
    unmatched = []
    for rule in [*defaults, *overrides]:
        hits = [fqn for fqn, module in modules.items() if rule.matches(fqn, module)]
        if not hits and rule in overrides:
            unmatched.append(rule)
        for fqn in hits:
            chosen[fqn] = rule
    return {fqn: rule for fqn, rule in chosen.items() if rule.style != "none"}, unmatched
