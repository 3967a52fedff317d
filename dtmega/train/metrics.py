"""Training metrics: FLOPs, MFU, memory, and where they go (rich, TensorBoard, metrics.jsonl)."""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.live import Live
from rich.table import Table

from dtmega.cost.datasheets import GPU_PEAK_TFLOPS
from dtmega.printing import console


def flops_per_token(config, seq_length: int, spec=None) -> float:
    """Model FLOPs per trained token from the model's spec (dtmega's Llama formula by default)."""
    from dtmega.models.llama.specs import llama_flops_per_token

    return (spec.flops_per_token if spec is not None else llama_flops_per_token)(config, seq_length)


def measure_cpu_peak_flops(seconds: float = 0.5, size: int = 1024) -> float:
    """FLOP/s this process reaches on an fp32 matmul (the CPU has no datasheet figure to use),
    measured as `dtmega calibrate` measures it."""
    from dtmega.cost.calibrate import matmul_flops

    return matmul_flops(size, size, size, "float32", "cpu", seconds)


def peak_flops(device_type: str, low_precision: bool) -> tuple[float, str]:
    """(peak FLOP/s per device, where the figure comes from)."""
    if device_type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, (half, single) in GPU_PEAK_TFLOPS.items():
            if key in name:
                return (half if low_precision else single) * 1e12, f"datasheet {key} {'bf16/fp16' if low_precision else 'fp32'}"
        return float("nan"), f"unknown GPU {name!r}: no datasheet peak, MFU not reported"
    # Rank 0 measures alone (the others wait) so ranks sharing cores do not skew the figure.
    import torch.distributed as dist

    value = [measure_cpu_peak_flops() if not dist.is_initialized() or dist.get_rank() == 0 else 0.0]
    if dist.is_initialized():
        dist.broadcast_object_list(value, src=0)
    flops = value[0]
    return flops, f"measured CPU fp32 matmul peak of one rank alone, {flops / 1e9:.1f} GFLOP/s"


def memory_gib(device_type: str) -> float:
    """Peak memory of this rank: allocated device memory on CUDA, resident set size on CPU."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLogger:
    """Writes each logged step to rank 0's console (a live table on a terminal, one line per
    log otherwise), a JSONL file (every field) and the sinks (metric_sinks.py: TensorBoard,
    W&B; the fields `for_sinks` keeps)."""

    COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu", "memory_gib")
    LIVE_ROWS = 15

    def __init__(self, *, leader: bool, log_file: str | None, console: Console, sinks: list | None = None,
                 for_sinks: Callable[[str], bool] | None = None, columns: tuple[str, ...] | None = None):
        self.leader, self.console = leader, console
        self.columns = columns or self.COLUMNS
        self.sinks = list(sinks or [])
        self.for_sinks = for_sinks or (lambda key: True)
        self.jsonl = self.live = None
        self.rows: list[tuple[str, ...]] = []
        if leader and log_file:
            Path(log_file).parent.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(log_file, "a")
        if leader and console.is_terminal:
            self.live = Live(self._table(), console=console, refresh_per_second=4)
            self.live.start()

    def _write(self, record: dict, prefix: str) -> None:
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        self._to_sinks(record, prefix)

    def _to_sinks(self, record: dict, prefix: str) -> None:
        if self.sinks:
            kept = {key: value for key, value in record.items() if key == "step" or self.for_sinks(key)}
            for sink in self.sinks:
                sink.write(prefix, kept)

    def log_scalars(self, record: dict) -> None:
        """One step's own values for the sinks only, as given (--tensorboard-log-interval: the
        per-step series that the --log-interval records then leave out)."""
        if self.leader:
            for sink in self.sinks:
                sink.write("train", record)

    def _table(self, rows: list[tuple[str, ...]] | None = None, header: bool = True) -> Table:
        table = Table(show_header=header, box=None, pad_edge=False)
        for column in self.columns:
            table.add_column(column, justify="right", width=max(11, len(column)))
        for row in rows if rows is not None else self.rows[-self.LIVE_ROWS:]:
            table.add_row(*row)
        return table

    @staticmethod
    def _cell(column: str, value) -> str:
        if value is None:
            return "-"
        if column == "lr":
            return f"{value:.3e}"
        if column in ("loss", "grad_norm", "mfu", "tflops_per_device", "moe_loss", "mtp_loss", "expert_load_max", "dropped"):
            return f"{value:.4f}"
        return f"{value:,.1f}" if isinstance(value, float) else str(value)

    def log(self, record: dict) -> None:
        """One training step's metrics (identical on every rank; only the leader writes)."""
        if not self.leader:
            return
        self._write(record, "train")
        row = tuple(self._cell(c, record.get(c)) for c in self.columns)
        self.rows.append(row)
        if self.live:
            self.live.update(self._table())
        else:
            self.console.print(self._table([row], header=len(self.rows) == 1))

    def log_validation(self, step: int, loss: float, split: str = "valid") -> None:
        """A validation (or, `split="test"`, test) result: loss and perplexity."""
        if not self.leader:
            return
        key = "val" if split == "valid" else split
        record = {"step": step, f"{key}_loss": loss, f"{key}_ppl": math.exp(min(loss, 50.0))}
        self._write(record, split)
        what = "validation" if split == "valid" else split
        self.event(f"step {step}: {what} loss {loss:.4f}, perplexity {record[f'{key}_ppl']:.2f}")

    def log_expert_load(self, step: int, loads: dict[str, list[float]]) -> None:
        """A table of each MoE layer's per-expert load, as a multiple of an even share (1.00 =
        balanced); with many experts, each layer's least, median and most loaded expert."""
        if not self.leader or not loads:
            return
        experts = len(next(iter(loads.values())))
        few = experts <= 16
        table = Table(title=f"step {step}: expert load (x even share)", box=None, pad_edge=False, title_justify="left")
        table.add_column("layer")
        for column in ([f"e{i}" for i in range(experts)] if few else ["least", "median", "most"]):
            table.add_column(column, justify="right")
        for layer, load in loads.items():
            shares = [value * experts for value in load]
            cells = shares if few else [min(shares), sorted(shares)[experts // 2], max(shares)]
            table.add_row(layer, *(f"{value:.2f}" for value in cells))
        (self.live.console if self.live else self.console).print(table)

    def event(self, message: str) -> None:
        """A one-off line (evaluation results, checkpoints)."""
        if self.leader:
            (self.live.console if self.live else self.console).print(message)

    def close(self) -> None:
        if self.live:
            self.live.stop()
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self.jsonl:
            self.jsonl.close()


def make_console(leader: bool) -> Console:
    """Rank 0's console (wide when not a terminal, so logs stay one line per step)."""
    return console(leader=leader)
