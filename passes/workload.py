"""The shapes a training step will run, for checks that need more than the model and mesh.

`check_plan(model, mesh_shape, plan, workload=Workload(seq_len=8192, micro_batch=1))` lets the
passes refuse, before launch, what would otherwise fail in the first step: a sequence that
context parallelism cannot cut evenly, one longer than the model's position table, too few
micro-batches for a pipeline schedule, a sequence that sequence parallelism cannot shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtmega.passes.errors import PlanError


@dataclass(frozen=True)
class Workload:
    """Per-rank step shapes: tokens per sequence, sequences per micro-batch, micro-batches per
    step (None: the plan's default), and the compute dtype's name."""

    seq_len: int
    micro_batch: int = 1
    microbatches: int | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"Workload({name}={value!r}) must be a positive integer")
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise PlanError(f"Workload(microbatches={self.microbatches!r}) must be a positive integer")
