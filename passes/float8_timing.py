"""Float8's measured choice for each projection: FP8 or bf16, by timing both at the run's
per-rank shapes on the device (kernels/measured_choice.py keeps the answers on disk).

A projection wins from FP8 only where the faster GEMM saves more than the casts, the amaxes and
the scaled outputs cost; that depends on its width, the tokens per rank and the card, which
is why a fixed `min_features` guesses wrong at both ends (torchao's filter: 1024). Here each
distinct shape is measured once: forward and backward of the FP8 linear under the plan's
recipe (delayed scaling with a ready history, as in the step) against `F.linear` in the
workload's dtype; ties within 3 % keep bf16 (same speed, more precision).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from dtmega.passes.program import Program

CANDIDATES = ("bf16", "fp8")  # the preference on a tie: bf16


@dataclass(frozen=True)
class LinearShape:
    """One FP8-eligible linear on one rank: `tokens` rows through `in_features` -> `out_features`."""

    tokens: int
    in_features: int
    out_features: int
    dtype: str
    recipe: str
    format: str

    def key(self, device: str) -> str:
        """What a measurement holds for."""
        return (f"linear T{self.tokens} {self.in_features}->{self.out_features} {self.dtype} fp8 {self.recipe}/"
                f"{self.format} on {device} (torch {torch.__version__})")


def linear_shape(program: Program, fqn: str, module: torch.nn.Linear, recipe: str, fmt: str) -> LinearShape | None:
    """`fqn`'s shape on this rank for the program's workload (None without one): tensor
    parallelism splits a column-parallel linear's outputs and a row-parallel one's inputs, and
    the linear sees every token of this rank's sequence part (SP gathers before, scatters after)."""
    workload = program.workload
    if workload is None:
        return None
    tp, cp = max(program.role_size("tensor"), 1), max(program.role_size("context"), 1)
    style = program.layout[fqn].style
    inputs = module.in_features // tp if style == "rowwise" else module.in_features
    outputs = module.out_features // tp if style == "colwise" else module.out_features
    return LinearShape(workload.micro_batch * workload.seq_len // cp, inputs, outputs, workload.dtype, recipe, fmt)


def device_linear_timer(shape: LinearShape, device: torch.device) -> Callable[[str], float]:
    """Seconds per forward + backward of the linear in each precision on `device`."""
    from dtmega.kernels.float8 import Float8Recipe
    from dtmega.kernels.float8_linear import Float8State, float8_linear, reduce_and_update_scales
    from dtmega.kernels.measured_choice import device_timer

    dtype = getattr(torch, shape.dtype)
    x = torch.randn(shape.tokens, shape.in_features, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(shape.out_features, shape.in_features, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(shape.tokens, shape.out_features, device=device, dtype=dtype)
    recipe = Float8Recipe(shape.recipe, shape.format, 16)
    state = Float8State(16, device) if shape.recipe == "delayed" else None

    def fp8() -> None:
        float8_linear(x, w, None, recipe, state, None).backward(grad)

    def bf16() -> None:
        F.linear(x, w).backward(grad)

    if state is not None:  # a history as in the step: scales from it, not from the tensors
        fp8()
        reduce_and_update_scales([state], recipe, None)
    runs = {"fp8": fp8, "bf16": bf16}
    return lambda candidate: device_timer(runs[candidate], device.type)
