"""Choosing among kernels by measuring them once, the answer kept on disk.

A `MeasuredChoice` picks, for a key (what is run: op, shapes, dtype, device, torch's version),
the fastest of some candidates by a `timer(candidate) -> seconds` (raising: the candidate cannot
run this; it is dropped), and remembers the answer in a JSON file, so a later run (or another
rank on the same machine) reads it instead of measuring again. Times within `tie` of the fastest
count as equal and the first of `preference` among them wins, so every rank picks the same
kernel from its own measurement. On a machine without the device, tests drive it with a fake
timer; a real timer runs each candidate's forward and backward on the device
(`device_timer`).

The file (`$DTMEGA_CACHE_DIR/kernel_choices.json`, default `~/.cache/dtmega/`) is written whole
to a temporary name and renamed: a reader never sees half of it; a damaged file is measured
over.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

CACHE_FILE = "kernel_choices.json"


def default_cache_path() -> Path:
    """Where measured choices are kept: $DTMEGA_CACHE_DIR, else ~/.cache/dtmega."""
    root = os.environ.get("DTMEGA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dtmega")
    return Path(root) / CACHE_FILE


@dataclass
class Choice:
    """The chosen candidate and every candidate's measured seconds (None: it could not run)."""

    chosen: str
    seconds: dict[str, float | None] = field(default_factory=dict)
    cached: bool = False  # read from the file, not measured now

    def describe(self) -> str:
        """'flash (0.41 ms; cudnn 0.44, math 1.90, efficient: cannot run)'."""
        others = [f"{name} {1e3 * t:.2f}" if t is not None else f"{name}: cannot run"
                  for name, t in self.seconds.items() if name != self.chosen]
        best = self.seconds.get(self.chosen)
        head = f"{self.chosen} ({1e3 * best:.2f} ms" if best is not None else f"{self.chosen} ("
        return head + ("; " if best is not None and others else "") + ", ".join(others) + ")" + \
            (" [cached]" if self.cached else "")


class MeasuredChoice:
    """Measured choices for one kind of decision, kept in `path` under `kind`."""

    def __init__(self, kind: str, path: Path | str | None = None, *, tie: float = 0.03,
                 preference: Iterable[str] = ()):
        self.kind, self.path = kind, Path(path) if path is not None else default_cache_path()
        self.tie, self.preference = tie, tuple(preference)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def cached(self, key: str) -> Choice | None:
        """The choice recorded for `key`, if any."""
        entry = self._read().get(self.kind, {}).get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("chosen"), str):
            return None
        return Choice(entry["chosen"], dict(entry.get("seconds", {})), cached=True)

    def choose(self, key: str, candidates: Iterable[str], timer: Callable[[str], float]) -> Choice:
        """The recorded choice for `key`, else the fastest of `candidates` by `timer` (recorded).
        ValueError if no candidate runs."""
        known = self.cached(key)
        candidates = list(candidates)
        if known is not None and known.chosen in candidates:
            return known
        seconds: dict[str, float | None] = {}
        for name in candidates:
            try:
                seconds[name] = float(timer(name))
            except Exception:  # noqa: BLE001 (a kernel that cannot run this shape or dtype is not a candidate)
                seconds[name] = None
        ran = {name: t for name, t in seconds.items() if t is not None}
        if not ran:
            raise ValueError(f"none of {candidates} could run {key}")
        fastest = min(ran.values())
        near = [name for name, t in ran.items() if t <= fastest * (1 + self.tie)]
        ranked = sorted(near, key=lambda name: (self.preference.index(name) if name in self.preference
                                                 else len(self.preference), ran[name]))
        choice = Choice(ranked[0], seconds)
        self._record(key, choice)
        return choice

    def _record(self, key: str, choice: Choice) -> None:
        data = self._read()
        data.setdefault(self.kind, {})[key] = {"chosen": choice.chosen, "seconds": choice.seconds}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
            with os.fdopen(handle, "w") as out:
                json.dump(data, out, indent=1, sort_keys=True)
            os.replace(temporary, self.path)
        except OSError:
            pass  # a read-only home: the choice holds for this run, measured again next time


def device_timer(run: Callable[[], None], device_type: str, *, warmup: int = 3, repeats: int = 10) -> float:
    """Seconds per call of `run` on the device (CUDA events; the host clock elsewhere), after
    `warmup` calls (compilation, autotuning, allocation)."""
    import time

    import torch

    for _ in range(warmup):
        run()
    if device_type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    began = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - began) / repeats
