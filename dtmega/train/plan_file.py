"""Passes of one's own for `dtmega train`: read from a plan TOML, composed with the passes the flags build.

A plan file holds `[[passes]]` tables (the same tables `Plan.to_toml` writes):

    [[passes]]
    pass = "MLPTensorParallel"          # the class name (registered when its module is imported)
    module = "examples.custom_pass"     # optional: imported first
    replaces = "TensorParallel"         # optional: runs instead of the pass of that class the flags build
    axis = "tp"                         # the pass's own fields

Each pass is added to the flag-built plan where its own declarations put it: after every pass
whose capability it `requires` or must run `after`, as early as that allows (before the passes
that fill what nobody decided: data parallelism, fused kernels), the file's passes in file order.
A pass that provides what a flag-built pass provides, or is of the same class, is refused by
name unless it `replaces` it; nothing the flags built is dropped silently.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtmega.kernels.errors import MissingInput
from dtmega.passes import Pass, PlanError
from dtmega.passes.base import matches_capability
from dtmega.passes.toml_io import load_toml
from dtmega.train.arg_fields import ArgumentError

ENTRY_KEYS = ("pass", "module", "replaces")  # a [[passes]] table's keys that are not the pass's fields


@dataclass(frozen=True)
class CustomPass:
    """One `[[passes]]` table: the pass, and the flag-built pass it replaces (by class name) if any."""

    instance: Pass
    replaces: str | None = None


@dataclass(frozen=True)
class CustomPlan:
    """The passes of a plan file (`where` names it in messages: `--plan FILE`, or --config's tables)."""

    where: str
    passes: tuple[CustomPass, ...]


def read_plan_file(source: str) -> CustomPlan:
    """The passes of `source` (a plan TOML's path, or its text: --config's [[passes]]), each
    entry's `module` imported first; ArgumentError naming the table and the fix for a file
    that cannot be read, an unknown key, pass or field, or a field of the wrong type."""
    inline = "\n" in source
    where = "--config's [[passes]]" if inline else f"--plan {source}"
    if not inline and not Path(source).is_file():
        raise ArgumentError(f"{where}: no such file. Fix: the path of a TOML file of [[passes]] tables")
    try:
        data = load_toml(source if inline else Path(source))
    except (PlanError, MissingInput) as error:
        raise ArgumentError(f"{where}: {error}. Fix: correct the TOML (tables [[passes]] with pass = \"ClassName\")") from None
    unknown = sorted(set(data) - {"passes"})
    if unknown:
        raise ArgumentError(f"{where}: unknown key(s) {unknown}; a plan file holds [[passes]] tables only. Fix: put "
                            "options in --config (a config may hold [[passes]] too), and each pass's fields in its table")
    tables = data.get("passes")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ArgumentError(f"{where}: no [[passes]] tables. Fix: one [[passes]] table per pass, with pass = "
                            "\"ClassName\" and its fields")
    return CustomPlan(where, tuple(_entry(where, number, table) for number, table in enumerate(tables, 1)))


def _entry(where: str, number: int, table: dict[str, Any]) -> CustomPass:
    """One [[passes]] table as a CustomPass (its module imported, its fields checked)."""
    name = table.get("pass")
    label = f"{where}: [[passes]] table {number}" + (f" ({name})" if isinstance(name, str) else "")
    if not isinstance(name, str):
        raise ArgumentError(f"{label} has no pass = \"ClassName\". Fix: name the pass's class, e.g. pass = "
                            "\"MLPTensorParallel\"")
    for key in ("module", "replaces"):
        if key in table and not isinstance(table[key], str):
            raise ArgumentError(f"{label}: {key} = {table[key]!r} must be a string. Fix: {key} = \"...\" in quotes")
    module = table.get("module")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ArgumentError(f"{label}: module = {module!r}: {error}. Fix: a module importable from here (on "
                                "PYTHONPATH, or a package installed in this environment)") from None
    fields = {key: value for key, value in table.items() if key not in ENTRY_KEYS}
    kind = Pass.registered(name)
    if kind is not None:
        _check_field_types(label, kind, fields)
    try:
        instance = Pass.from_dict({"pass": name, **fields})
    except PlanError as error:
        message = str(error)
        if "unknown pass" in message:
            message += f". Fix: module = \"the.module.defining.{name}\" in its table, or --custom-import that module"
        elif "has no option" in message:
            message += f". Fix: only {name}'s own fields, beside pass, module and replaces"
        elif "Fix" not in message:
            message += f". Fix: values {name} takes"
        raise ArgumentError(f"{label}: {message}") from None
    except TypeError as error:  # a field without a default left out
        raise ArgumentError(f"{label}: {error}. Fix: give {name}'s required fields in its table") from None
    return CustomPass(instance, table.get("replaces"))


def _check_field_types(label: str, kind: type[Pass], given: dict[str, Any]) -> None:
    """A TOML value of another type than the field's default (`axis = 2`, `every = "2"`) is refused:
    the pass would run with something other than what was meant."""
    for field in dataclasses.fields(kind):  # type: ignore[arg-type]
        if field.name not in given or field.default is dataclasses.MISSING or field.default is None:
            continue
        wanted, value = type(field.default), given[field.name]
        fits = isinstance(value, wanted) and not (wanted is int and isinstance(value, bool))
        if (wanted is float and isinstance(value, int) and not isinstance(value, bool)) or (wanted is tuple and
                                                                                          isinstance(value, list)):
            fits = True  # TOML has no tuples; a whole number is a real
        if not fits:
            raise ArgumentError(f"{label}: {field.name} = {value!r} is {_a(type(value).__name__)}, but {kind.__name__}."
                                f"{field.name} takes {_a(wanted.__name__)}. Fix: write it as one, e.g. {field.name} = "
                                f"{json.dumps(field.default)}")


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def compose_plan(flag_built: list[Pass], custom: CustomPlan | None) -> list[Pass]:
    """The run's passes: the flag-built ones with the custom plan's passes in place (see the
    module docstring). ArgumentError, naming both passes, for a custom pass that would do what a
    flag-built one does, or that replaces a pass the flags do not build."""
    if custom is None:
        return list(flag_built)
    passes = list(flag_built)
    added: list[Pass] = []
    replaced: dict[str, str] = {}
    for entry in custom.passes:
        if entry.replaces is None:
            added.append(entry.instance)
            continue
        if entry.replaces in replaced:
            raise ArgumentError(f"{custom.where}: {replaced[entry.replaces]} and {entry.instance.name} both replace "
                                f"{entry.replaces}. Fix: keep one of them")
        index = next((i for i, p in enumerate(passes) if p.name == entry.replaces and any(p is f for f in flag_built)),
                     None)
        if index is None:
            built = ", ".join(p.name for p in flag_built) or "no pass"
            raise ArgumentError(f"{custom.where}: {entry.instance.name} replaces = {entry.replaces!r}, but the flags "
                                f"build no {entry.replaces} (they build {built}). Fix: drop replaces (the pass is then "
                                f"added), or add the flag that builds {entry.replaces}")
        replaced[entry.replaces] = entry.instance.name
        passes[index] = entry.instance
    kept = [p for p in passes if any(p is f for f in flag_built)]
    for mine in [entry.instance for entry in custom.passes]:
        for theirs in kept:
            _refuse_overlap(custom.where, mine, theirs)
    last = -1
    for mine in added:
        position = max([last, *(i for i, p in enumerate(passes) if _must_follow(mine, p))]) + 1
        passes.insert(position, mine)
        last = position
    return passes


def _must_follow(mine: Pass, other: Pass) -> bool:
    """Whether `mine` must come after `other`: it requires, or runs after, what `other` provides."""
    provided = other.provided()
    return any(needed in provided for needed in mine.required()) or any(
        matches_capability(pattern, capability) for pattern in mine.runs_after() for capability in provided)


def _refuse_overlap(where: str, mine: Pass, theirs: Pass) -> None:
    """ArgumentError if a custom pass is of the class of a flag-built pass, or provides what it provides."""
    shared = sorted(set(mine.provided()) & set(theirs.provided()))
    if mine.name != theirs.name and not shared:
        return
    what = f"both provide {shared[0]!r}" if shared else "are the same pass"
    raise ArgumentError(f"{where}: {mine.name} and {theirs.name}, which the flags build, {what}; one would undo "
                        f"or repeat the other. Fix: replaces = \"{theirs.name}\" in {mine.name}'s [[passes]] table "
                        f"(it then runs instead of the flags' {theirs.name}), or drop the flag that builds "
                        f"{theirs.name}, or drop {mine.name}")
