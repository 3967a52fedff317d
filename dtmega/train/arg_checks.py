"""Value checks of `dtmega train` options, from the command line and from a TOML file alike.

argparse types a flag's value; a TOML file arrives already typed by TOML, so `bf16 = "false"`
(a string, which Python reads as true) or `data_path = "x"` (a string, iterated character by
character) would run as something else than the user wrote. `check_toml_types` holds TOML
values to the type their flag takes. `check_ranges` refuses sizes and counts that cannot mean
anything (a zero micro-batch, a negative learning rate), naming the flag, instead of letting a
later `or 1` or an empty split turn them into another run.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from dtmega.kernels.errors import DtmegaError


class OptionValueError(DtmegaError):
    """An option's value cannot mean anything; the message names the flag and the fix."""


def flag_of(name: str) -> str:
    """The command-line spelling of a TrainArgs field."""
    return "--" + name.replace("_", "-")


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}.get(
        type(value), type(value).__name__)


def check_toml_types(values: dict[str, Any], kinds: dict[str, type], source: str) -> dict[str, Any]:
    """Each TOML value has the type its flag takes: bool for switches, int for counts (a whole
    float is not taken either: `train_iters = 3.0` is a typo's sign), int or float for reals,
    a list for list options, a string for the rest (a bare number there is taken as its text,
    as the command line would give it: `moe_layer_freq = 2`). Returns the values so
    normalized; raises OptionValueError naming the key."""
    checked = dict(values)
    for key, value in values.items():
        kind = kinds.get(key)
        if kind is None or value is None:
            continue
        if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
            checked[key] = str(value)
            continue
        wrong = {
            bool: not isinstance(value, bool),
            int: isinstance(value, bool) or not isinstance(value, int),
            float: isinstance(value, bool) or not isinstance(value, (int, float)),
            list: not isinstance(value, list),
            str: not isinstance(value, str),
        }[kind]
        if wrong:
            example = {bool: "true or false (no quotes)", int: "a whole number (no quotes)",
                       float: "a number (no quotes)", list: '["item", ...]', str: '"text" (in quotes)'}[kind]
            raise OptionValueError(
                f"{source}: {key} = {value!r} is {_type_name(value)}, but {flag_of(key)} takes "
                f"{_type_name(kind())}. Fix: write {key} = {example}"
            )
        if kind is list and any(isinstance(item, (list, dict)) for item in value):
            raise OptionValueError(f"{source}: {key} = {value!r} nests lists or tables; {flag_of(key)} takes a flat "
                                   "list of strings and numbers")
    return checked


INT64_MAX = (1 << 63) - 1


def check_ranges(args: Any) -> None:
    """Refuses zero or negative sizes and counts, negative rates and non-finite reals, naming
    the flag (the same on every rank: it reads the arguments only). Each section of the
    arguments lists its own bounded fields (`at_least_one`, `at_least_zero`, `positive`)."""
    for f in fields(args):
        value = getattr(args, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise OptionValueError(f"{flag_of(f.name)} {value}: must be a finite number")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
            # matrix 3, A4: a TOML integer past int64 reached numpy and ran until memory was gone
            raise OptionValueError(f"{flag_of(f.name)} {value}: beyond the largest whole number dtmega takes "
                                   f"({INT64_MAX}). Fix: a realistic value")
    sections = [cls for cls in type(args).__mro__ if cls is not object]
    for group, bound, words in (("at_least_one", 1, "at least 1"), ("at_least_zero", 0, "0 or more"),
                                ("positive", None, "greater than 0")):
        for name in [name for cls in sections for name in vars(cls).get(group, ())]:
            value = getattr(args, name, None)
            if value is None or isinstance(value, bool):
                continue
            bad = value <= 0 if bound is None else value < bound
            if bad:
                raise OptionValueError(f"{flag_of(name)} {value}: must be {words}. Fix: pass a value {words}"
                                       + (", or leave it out to derive it" if _derivable(args, name) else ""))
    for name in [name for cls in sections for name in vars(cls).get("unit_interval", ())]:
        value = getattr(args, name, None)
        if value is not None and not 0 <= value < 1:
            raise OptionValueError(f"{flag_of(name)} {value}: must be at least 0 and below 1. Fix: pass a value in "
                                   f"[0, 1), e.g. {next(f for f in fields(args) if f.name == name).default}")


def _derivable(args: Any, name: str) -> bool:
    """Whether leaving the flag out lets the run derive it (its default is None)."""
    return next(f for f in fields(args) if f.name == name).default is None
