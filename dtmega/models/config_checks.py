"""Range checks every model config shares: the numbers a decoder divides by, exponentiates or
scales with (RoPE's base, a norm's epsilon, a scaling factor) must be finite and in range, or
the model computes NaN without a word (reliability matrix 3, F7: `rope_theta` 0 or NaN in a
`config.json`). Called from each config's `__post_init__`, so flags, Hugging Face configs and
Python all meet the same rule."""

from __future__ import annotations

import math
from typing import Any


def number_problems(config: Any, positive: tuple[str, ...] = (), at_least_one: tuple[str, ...] = (),
                    non_negative: tuple[str, ...] = ()) -> list[str]:
    """One line per field of `config` that is not a finite number in its range: `positive` (> 0),
    `at_least_one` (>= 1: a stretch factor) and `non_negative` (>= 0)."""
    problems = []
    for names, test, wanted in ((positive, lambda v: v > 0, "a finite number above 0"),
                                (at_least_one, lambda v: v >= 1, "a finite number of at least 1"),
                                (non_negative, lambda v: v >= 0, "a finite number of at least 0")):
        for name in names:
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not test(value):
                problems.append(f"{name} must be {wanted}, got {value!r}")
    return problems
