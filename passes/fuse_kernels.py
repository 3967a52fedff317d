"""Fused hot paths as a pass: `FuseKernels()` picks a kernel per module and writes it in the layout.

Norms run `rms_norm`, the residual add before a block's second norm `rms_norm_residual`, the
MLP's activation `swiglu`, q and k their RoPE in one `rope_qk` launch, and the output layer
with the loss `fused_linear_cross_entropy` (the logits are never materialized; vocab-parallel
under tensor parallelism). Each is a custom op of `dtmega.kernels` with a plain-PyTorch
reference (the CPU path) and a Triton implementation (CUDA); `impl="auto"` takes Triton where
the device is CUDA and triton imports, the reference elsewhere, and the layout records which
(`rms_norm.triton`, `cross_entropy.fused_linear.reference`, ...), so the report shows what runs.
Each op can be turned off (`FuseKernels(rope=False)`, the trainer's `--no-rope-fusion`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtmega.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy_sum
from dtmega.kernels.triton_support import triton_available
from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.fused_modules import KNOWN, check_site, fused_module
from dtmega.passes.fused_ops import FUSED_OPS, LOSS
from dtmega.passes.hidden_out import OutputOrHiddenParallel, install_hidden_out
from dtmega.passes.loss import Loss, register_loss
from dtmega.passes.program import Program
from dtmega.passes.results import Compilation, PassResult
from dtmega.passes.runtime import Batch
from dtmega.passes.slots import swap_module
from dtmega.passes.tp_styles import _src, register_style_variant

IMPLS = ("auto", "triton", "reference")


@dataclass(frozen=True)
class FusedLoss(PassResult):
    """The fused loss's chunking (tokens per chunk; None: the kernel's default)."""

    chunk_size: int | None = None

@dataclass
class FuseKernels(Pass):
    """Runs the model's hot paths through fused kernels (see the module docstring)."""

    rms_norm: bool | None = None  # None: fused unless the blocks are compiled on a GPU (see finalize)
    swiglu: bool | None = None
    rope: bool | None = None
    cross_entropy: bool = True
    impl: str = "auto"
    chunk_size: int | None = None  # tokens per chunk of the fused loss (None: ~256 MiB of fp32 logits)
    # in blocks compiled on a GPU, each in-block op left on None keeps its kernel or goes to the
    # compiler by a measurement (passes/fused_op_timing.py); `timer(op, candidate) -> seconds`
    # replaces it (tests: a fake timer), `cache` is the file of measured choices
    timer: Callable[[str, str], float] | None = None
    cache: str | None = None

    provides = ("fused_kernels",)
    after = ("context_parallel@*",)  # CP replaces attention cores; RoPE is applied before them

    def _impl(self, program: Program) -> str:
        if self.impl not in IMPLS:
            raise PlanError(f"FuseKernels(impl={self.impl!r}) is unknown; use one of {IMPLS}")
        if self.impl != "auto":
            return self.impl
        device = program.mesh.device_type if program.mesh is not None else (
            "cuda" if torch.cuda.is_available() else "cpu")
        return "triton" if device == "cuda" and triton_available() else "reference"

    def annotate(self, program: Program) -> None:
        impl = self._impl(program)
        family = program.family
        if family is None:
            program.facts  # raises the "no family knows this model" error
        wanted = {op.name: getattr(self, op.switch) is not False for op in FUSED_OPS.values() if op.in_blocks}
        sites = family.fusion_sites(program.model) if family.fusion_sites is not None else {}
        if family.fusion_sites is None and any(wanted.values()):
            program.note(f"FuseKernels: the {family.name} family declares no fusion sites (ModelFamily.fusion_sites): "
                         "its norms, MLPs and RoPE run unfused")
        count = 0
        for op, fqns in sites.items():
            if not wanted.get(op):
                continue
            for fqn in fqns:
                check_site(op, fqn, program.modules[fqn])  # a module the kernel does not know: refused by name
                entry = program.layout[fqn]
                if entry.kernel is None:
                    entry.kernel = f"{op}.{impl}"
                    count += 1
        if self.cross_entropy:
            output = program.layout[program.facts.output]
            if output.style not in (None, "output"):
                raise PlanError(f"FuseKernels cannot fuse the loss into {program.facts.output}, which has style "
                                f"{output.style!r}. Fix: FuseKernels(cross_entropy=False)")
            output.kernel = f"{LOSS}.{impl}"
            count += 1
            program.record(FusedLoss(self.chunk_size))
        program.note(f"FuseKernels({impl}): {count} modules")

    def finalize(self, program: Program) -> None:
        """Inside compiled blocks a fused kernel competes with inductor's own code for the same
        op: each in-block op left on `None` keeps its kernel or goes back to the compiler, by a
        measurement of both at this run's shapes on the device, once (kept on disk;
        passes/fused_op_timing.py), or by `timer`. Without a GPU to measure on or a workload to
        take shapes from, the rule measured on an H100 holds (Llama 1.5 B: inductor's fusion beat
        the kernels, 58,649 against 56,982 tokens/s), so they go back to the compiler there. The
        fused loss (outside the blocks) stays. Eagerly, and on the CPU (references), every
        kernel runs."""
        if program.result(Compilation) is None or (self._impl(program) != "triton" and self.timer is None):
            return
        auto = {op.name for op in FUSED_OPS.values() if op.in_blocks and getattr(self, op.switch) is None}
        present = sorted({entry.kernel.rpartition(".")[0] for entry in program.layout.modules.values()
                          if entry.kernel and entry.kernel.rpartition(".")[0] in auto})
        keep = self._measured_keep(program, present)
        returned = 0
        for entry in program.layout.modules.values():
            op = entry.kernel.rpartition(".")[0] if entry.kernel else None
            if op in auto and not keep.get(op, False):
                entry.kernel, returned = None, returned + 1
        if returned:
            program.note(f"FuseKernels: {returned} norm/SwiGLU/RoPE modules left to the compiled blocks "
                         f"(faster there: {', '.join(op for op in present if not keep.get(op, False))})")

    def _measured_keep(self, program: Program, ops: list[str]) -> dict[str, bool]:
        """op -> whether its fused kernel beat inductor's code (measured or by `timer`); ops
        that cannot be measured are absent (they go back to the compiler)."""
        from dtmega.kernels.measured_choice import MeasuredChoice
        from dtmega.passes.fused_op_timing import CANDIDATES, device_op_timer, op_shapes

        shapes = op_shapes(program)
        device = program.mesh.device_type if program.mesh is not None else None
        can_measure = device == "cuda" and torch.cuda.is_available()
        if not shapes or (self.timer is None and not can_measure):
            return {}
        name = torch.cuda.get_device_name() if can_measure else (device or "the planning machine")
        chooser = MeasuredChoice("fused_op", self.cache, preference=CANDIDATES)
        keep = {}
        for op in ops:
            shape = shapes.get(op)
            if shape is None:
                continue
            timer = (lambda candidate, op=op: self.timer(op, candidate)) if self.timer is not None else \
                device_op_timer(shape, torch.device("cuda", torch.cuda.current_device()))
            try:
                choice = chooser.choose(shape.key(name), CANDIDATES, timer)
            except ValueError:
                continue
            keep[op] = choice.chosen == "triton"
            program.note(f"FuseKernels: {op} in compiled blocks at {shape.key(name)}: {choice.describe()}")
        return keep

    def apply(self, program: Program) -> None:
        """Swaps each site's module for the fused one in its slot (passes/slots.py): the model's
        own forward calls it where it called the original."""
        for fqn, entry in program.layout.modules.items():
            if entry.kernel is None:
                continue
            op, _, impl = entry.kernel.rpartition(".")
            if op == LOSS:
                for module in program.modules_at(fqn):
                    install_hidden_out(module)  # logits, except hidden states inside the fused loss
            elif op in KNOWN:
                swap_module(program, fqn, lambda old, op=op, impl=impl: fused_module(op, old, impl),
                            f"FuseKernels({op})")


def _fused_output_style(entry, axis):
    """Tensor-parallel output layer whose loss is fused: vocab-sharded weight and logits, as
    the plain output style; inside the loss it passes its gathered input through."""
    return OutputOrHiddenParallel(input_layouts=_src(entry.inputs[axis]), output_layouts=Shard(-1),
                                  use_local_output=False)


def autocast_of(program: Program):
    """The autocast the plan runs forwards under (one-rank data parallelism in bf16/fp16), as
    a context manager factory: the fused loss is part of the forward and runs under it too."""
    precision = program.layout[""].precision if "" in program.layout else None
    if precision is None or not precision.autocast or program.mesh is None:
        return contextlib.nullcontext
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision.autocast]
    return lambda: torch.autocast(program.mesh.device_type, dtype=dtype)


def _fused_loss(program: Program, impl: str, chunk_size: int | None) -> Loss:
    """The output projection and cross entropy in one chunked kernel, over the hidden states the
    output layer hands it (the logits never exist); vocab-parallel under TP."""
    output_fqn = program.facts.output
    autocast = autocast_of(program)

    def criterion(owner, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        weight = owner.get_submodule(output_fqn).weight
        if isinstance(hidden, DTensor) and any(isinstance(p, Shard) for p in hidden.placements):
            hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
        with autocast():
            return fused_linear_cross_entropy_sum(hidden.flatten(0, 1), weight, batch.labels.flatten(),
                                                  batch.loss_mask.flatten(), impl=impl, chunk_size=chunk_size)

    return Loss(criterion, hidden_out=True)


for _impl in ("triton", "reference"):
    register_style_variant("output", f"{LOSS}.{_impl}", _fused_output_style)
    register_loss(f"{LOSS}.{_impl}", lambda program, impl=_impl: _fused_loss(
        program, impl, (program.result(FusedLoss) or FusedLoss()).chunk_size))
