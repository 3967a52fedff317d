"""Progress of long commands (evaluate, serve's start-up, preprocess, ...): a rich progress bar
with ETA on a terminal, and one line every few seconds when the output is a log file or a CI
console (where a live bar would print nothing until the end, or garbage).

    with progress_bar("evaluate", total=3564, unit="batches") as bar:
        for batch in batches:
            ...
            bar.advance()

The first line (or the bar) appears when the work starts, not after the first interval. Lines
come every `DTMEGA_PROGRESS_SECONDS` seconds (default 5); only the printing rank shows any.
"""

from __future__ import annotations

import os
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dtmega.printing import console as make_console

DEFAULT_INTERVAL_S = 5.0


def interval_seconds() -> float:
    """Seconds between two progress lines when not on a terminal (DTMEGA_PROGRESS_SECONDS)."""
    try:
        return max(0.0, float(os.environ.get("DTMEGA_PROGRESS_SECONDS", DEFAULT_INTERVAL_S)))
    except ValueError:
        return DEFAULT_INTERVAL_S


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def _mib(amount: float) -> str:
    return f"{amount / (1 << 20):.1f} MiB"


class ProgressBar:
    """One task's progress (module docstring); use `progress_bar(...)`."""

    def __init__(self, description: str, total: float | None, unit: str, console: Console, *, in_bytes: bool = False,
                 phased: bool = False):
        self.description, self.total, self.unit, self.console = description, total, unit, console
        self.title = description
        self.done = 0.0
        self.in_bytes, self.phased = in_bytes, phased
        self.live = console.is_terminal and not console.quiet
        self.started = self.last_line = time.monotonic()
        self.interval = interval_seconds()
        self._rich: Progress | None = None
        self._task = None
        self._phases = 0

    def __enter__(self) -> "ProgressBar":
        self.started = self.last_line = time.monotonic()
        if self.live:
            count = TextColumn("{task.fields[amount]}") if self.in_bytes else MofNCompleteColumn()
            self._rich = Progress(TextColumn("[bold]{task.description}"), BarColumn(), count,
                                  TextColumn(self.unit), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                  console=self.console, transient=False)
            self._rich.__enter__()
            self._task = self._rich.add_task(self.description, total=self.total, amount=self._amount())
        elif not self.phased:  # a phased task's first line is its first phase's
            self._line()
        return self

    def _amount(self) -> str:
        if self.in_bytes:
            return f"{_mib(self.done)}/{_mib(self.total)}" if self.total else _mib(self.done)
        return f"{self.done:g}/{self.total:g}" if self.total else f"{self.done:g}"

    def _line(self, final: bool = False) -> None:
        elapsed = time.monotonic() - self.started
        text = f"{self.description}: {self._amount()} {self.unit}".rstrip() if self.total or self.done else self.description
        if self.total:
            text += f" ({100 * self.done / self.total:.0f} %)"
        if final:
            text += f", done in {_duration(elapsed)}"
        elif self.done and elapsed > 0 and not self._phases:  # phases differ too much for a rate
            rate = self.done / elapsed
            text += f", {_mib(rate) + '/s' if self.in_bytes else f'{rate:.3g} {self.unit}/s'.replace(' /s', '/s')}"
            if self.total:
                text += f", {_duration((self.total - self.done) / rate)} left"
        self.console.print(text, highlight=False, soft_wrap=True)
        self.last_line = time.monotonic()

    def set_total(self, total: float) -> None:
        """The amount of work, once it is known (e.g. the number of shards a conversion writes)."""
        self.total = total
        if self._rich is not None:
            self._rich.update(self._task, total=total, amount=self._amount())

    def advance(self, amount: float = 1) -> None:
        """Marks `amount` more units done (a line is printed if the interval has passed)."""
        self.done += amount
        if self._rich is not None:
            self._rich.update(self._task, advance=amount, amount=self._amount())
        elif time.monotonic() - self.last_line >= self.interval:
            self._line()

    def describe(self, description: str) -> None:
        """Names what is being done now (a phase of the task); printed at once without a terminal."""
        self.description = description
        if self._rich is not None:
            self._rich.update(self._task, description=description)
        else:
            self._line()

    def phase(self, description: str) -> None:
        """Completes the previous phase (if any) and starts the next one, named: for work counted
        in phases (loading a checkpoint: its files' checks, the model, the weights)."""
        if self._phases:
            self.done += 1
            if self._rich is not None:
                self._rich.update(self._task, completed=self.done, amount=self._amount())
        self._phases += 1
        self.describe(f"{self.title}: {description}")

    def __exit__(self, kind, error, trace) -> None:
        if kind is None and self._phases and self.total:
            self.description, self.done = self.title, self.total
            if self._rich is not None:
                self._rich.update(self._task, description=self.title, completed=self.done, amount=self._amount())
        if self._rich is not None:
            self._rich.__exit__(kind, error, trace)
        elif kind is None:
            self._line(final=True)


def progress_bar(description: str, total: float | None = None, unit: str = "", *, console: Console | None = None,
                 in_bytes: bool = False, phased: bool = False) -> ProgressBar:
    """A progress display for `total` units of work (module docstring), on stderr (so a command's
    output can be piped); quiet on other ranks. `phased`: the work is counted by `phase(...)`."""
    return ProgressBar(description, total, unit, console or make_console(stderr=True), in_bytes=in_bytes,
                       phased=phased)
