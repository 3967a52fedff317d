"""`--log-straggler` (Megatron's flag): which ranks are slow, at every log step.

Each rank times, over the log window, its steps (host wall time per step) and the part of them it
spent fetching its batch. Fetching is rank-local work (its own files, its own CPU), so a slow
disk, a busy node or a slow tokenizer shows there on the rank that has it; the step time is what
the job pays (under synchronous collectives every rank waits for the slowest, so step times are
close and the slow rank shows in the local phases). One all-gather of two numbers per rank at
each log step, only when the flag is on. `--straggler-minmax-count N` names the N fastest and
slowest ranks of each.

On GPUs the step time is taken after the log step's device synchronization, so it is the
device's time per step averaged over the window, not the host's launch time.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtmega.mesh import gather_objects


@dataclass
class Extremes:
    """The fastest and slowest ranks of one measure: [(milliseconds, rank), ...] each."""

    fastest: list[tuple[float, int]]
    slowest: list[tuple[float, int]]

    def describe(self) -> str:
        def ranks(pairs: list[tuple[float, int]]) -> str:
            return ", ".join(f"{ms:.1f} ms (rank {rank})" for ms, rank in pairs)

        return f"min {ranks(self.fastest)}, max {ranks(self.slowest)}"


def extremes(values: list[float], count: int) -> Extremes:
    """The `count` smallest and largest of `values` (indexed by rank), in milliseconds."""
    ordered = sorted((value * 1000.0, rank) for rank, value in enumerate(values))
    count = max(1, min(count, len(ordered)))
    return Extremes(ordered[:count], ordered[::-1][:count])


class StragglerLog:
    """Accumulates this rank's window times; `report` gathers everyone's (collective)."""

    def __init__(self, minmax_count: int = 1):
        self.minmax_count = minmax_count
        self.data_seconds = 0.0

    def add_data_time(self, seconds: float) -> None:
        self.data_seconds += seconds

    def report(self, steps: int, window_seconds: float) -> tuple[dict, str]:
        """(metrics for metrics.jsonl, one console line) of the window; resets the window."""
        mine = (window_seconds / steps, self.data_seconds / steps)
        self.data_seconds = 0.0
        everyone = gather_objects(mine)
        step = extremes([s for s, _ in everyone], self.minmax_count)
        data = extremes([d for _, d in everyone], self.minmax_count)
        metrics = {
            "straggler_step_ms_min": step.fastest[0][0], "straggler_step_ms_min_rank": step.fastest[0][1],
            "straggler_step_ms_max": step.slowest[0][0], "straggler_step_ms_max_rank": step.slowest[0][1],
            "straggler_data_ms_min": data.fastest[0][0], "straggler_data_ms_min_rank": data.fastest[0][1],
            "straggler_data_ms_max": data.slowest[0][0], "straggler_data_ms_max_rank": data.slowest[0][1],
        }
        return metrics, f"stragglers: step time {step.describe()} | fetching the batch {data.describe()}"
