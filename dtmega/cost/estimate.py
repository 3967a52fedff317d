"""One plan's predicted cost: memory per rank, FLOPs, bytes per collective, step time, MFU."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.table import Table

from dtmega.cost.comm import Collective, collectives
from dtmega.cost.hardware import Hardware
from dtmega.cost.memory import MemoryBreakdown, gib, memory
from dtmega.cost.shapes import ModelShape, PlanShape
from dtmega.cost.step_time import StepTime, rank_flops, step_time


@dataclass(frozen=True)
class CostEstimate:
    """What a plan costs on one rank (the busiest) per training step."""

    model: ModelShape
    plan: PlanShape
    seq: int
    memory: MemoryBreakdown
    flops: float
    comms: list[Collective] = field(default_factory=list)
    time: StepTime | None = None
    hardware: Hardware | None = None

    @property
    def tokens_per_step(self) -> int:
        p = self.plan
        return p.micro_batch * p.microbatches * p.dp * self.seq

    @property
    def step_s(self) -> float | None:
        return self.time.total if self.time else None

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        return self.tokens_per_step / self.step_s / self.plan.world if self.time else None

    @property
    def mfu(self) -> float | None:
        """Model FLOPs (no recompute) per second over the peak of all ranks at the compute dtype's
        rate (bf16's for FP8 runs too, as Megatron-Core and torchtitan report MFU). With packed
        documents masked per document, attention counts each document's own work."""
        if not self.time or not self.hardware:
            return None
        per_token = self.model.flops_per_token(self.seq)
        # packed documents masked per document: the attention work they do, not the whole sequence's
        per_token -= 12.0 * self.model.layers * self.model.dim * (self.seq - self.plan.attention_keys(self.seq))
        model_flops = per_token * self.tokens_per_step
        return model_flops / (self.step_s * self.plan.world * self.hardware.flops(self.plan.dtype))

    def to_dict(self) -> dict:
        """The fields `dtmega plan --json` prints for each plan."""
        p = self.plan
        return {
            "plan": p.describe(), "tp": p.tp, "sp": p.sp, "pp": p.pp, "vp": p.vp, "schedule": p.schedule, "cp": p.cp,
            "cp_method": p.cp_method, "dp": p.dp, "dp_mode": p.dp_mode, "dp_shard": p.dp_shard, "ep": p.ep,
            "dispatcher": p.dispatcher, "micro_batch": p.micro_batch, "microbatches": p.microbatches, "recompute": p.recompute,
            "cpu_optimizer": p.cpu_optimizer, "framework": p.framework, "tp_overlap": p.tp_overlap, "fp8": p.fp8,
            "fp8_param_gather": p.fp8_param_gather, "recompute_layers": p.recompute_layers,
            "embedding_in_split": p.embedding_in_split, "memory_gib": round(gib(self.memory.peak), 3),
            "memory": {name: round(gib(value), 3) for name, value in self.memory.rows()},
            "step_s": self.step_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
            "tflops_per_rank": self.flops / 1e12,
            "collectives": [{"axis": c.axis, "kind": c.kind, "count": c.count, "tensor_bytes": c.tensor_bytes,
                             "wire_bytes": c.wire_bytes, "overlapped": c.overlapped} for c in self.comms],
        }

    def table(self) -> Table:
        """The per-rank budget: memory by purpose, then FLOPs, bytes and time."""
        title = f"predicted per rank: {self.plan.describe()}, seq {self.seq}"
        if self.hardware:
            title += f" on {self.hardware.name}"
        table = Table(title=title)
        table.add_column("what")
        table.add_column("amount", justify="right")
        for name, value in self.memory.rows():
            if value:
                table.add_row(f"memory: {name}" + (" (on the host)" if name == "host" else ""), f"{gib(value):.3f} GiB")
        table.add_row("[bold]memory: peak[/bold]", f"[bold]{gib(self.memory.peak):.3f} GiB[/bold]")
        table.add_row("FLOPs per step", f"{self.flops / 1e12:.3f} TFLOP")
        for c in self.comms:
            table.add_row(f"{c.axis} {c.kind} x{c.count:g}" + (" (overlapped)" if c.overlapped else ""),
                          f"{c.tensor_bytes / 2**20:.2f} MiB")
        if self.time:
            t = self.time
            for name in ("compute", "memory", "launches", "exposed_comm", "bubble", "optimizer"):
                table.add_row(f"time: {name}", f"{getattr(t, name) * 1e3:.2f} ms")
            table.add_row("[bold]step time[/bold]", f"[bold]{self.step_s:.4f} s[/bold]")
            table.add_row("tokens/s per rank", f"{self.tokens_per_s_per_gpu:,.0f}")
            table.add_row("MFU", f"{self.mfu:.1%}")
        return table


def estimate(model: ModelShape, plan: PlanShape, seq: int, hardware: Hardware | None = None) -> CostEstimate:
    """The cost of `plan` for `model` at sequence length `seq` (time only with `hardware`)."""
    comms = collectives(model, plan, seq)
    time = step_time(model, plan, seq, hardware, comms) if hardware else None
    return CostEstimate(model, plan, seq, memory(model, plan, seq), rank_flops(model, plan, seq), comms, time, hardware)
