"""Whole-step capture: forward, backward and the optimizer step of a `ParallelModel` compiled as
one program (`torch.compile` with Dynamo tracing the backward call), with CUDA graphs where the
step's shapes are static, and the reason printed wherever the capture falls back.

    step = dtmega.capture_step(pm, optimizer)          # backend="inductor"; "aot_eager" on CPU tests
    for batch in batches:
        loss = step(pm.shard_batch(batch))             # = forward_backward + optimizer.step + hooks

What stays outside the program, and why (each is in `step.reasons` and printed once):

* the batch's host side (`ParallelModel.begin_step`): validating token ids and counting the
  global loss tokens read the batch on the host, which a captured program cannot;
* `zero_grad`: gradients are set to None before each step (eagerly; the gradients of the last
  step stay readable after it, for a norm or a test);
* pipeline schedules: stages send and receive per micro-batch between ranks, so the schedule runs
  eagerly and only the optimizer step is compiled (compile the stages' blocks with `Compile()`);
* Dynamo's own graph breaks (torch's optimizer breaks the graph around its step by design,
  pytorch/pytorch#104053; FSDP2's hooks run between graphs): the program is then a few graphs,
  each compiled, counted and named in `step.describe()`.

Torch's own messages while the step compiles (Dynamo prints hundreds of traceback lines per frame
it gives up on under tensor parallelism) go to a log file per rank, not to the console; the
summary names it (dtmega/torch_messages.py).

CUDA graphs (`mode="reduce-overhead"`) are used on a GPU when every shape is static: not for
mixture-of-experts models (tokens per expert change every step), pipeline schedules, FSDP2
(its all-gathers run in hooks between graphs) or backends other than inductor. On the CPU the
suite checks the compiled step (`backend="aot_eager"`) against the eager one and the unsharded
model over 5 AdamW steps under every plan (tests/distributed/test_step_capture.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from dtmega.passes.errors import PlanError
from dtmega.torch_messages import TorchMessagesToFile, default_log_path

BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass
class CaptureReport:
    """What the capture holds after its first step: graphs compiled, Dynamo's graph breaks
    (first line of each reason), whether CUDA graphs replay them, and why anything falls back."""

    backend: str
    scope: str  # "step": forward + backward + optimizer; "optimizer": the optimizer step only
    cuda_graphs: bool
    reasons: list[str] = field(default_factory=list)
    graphs: int = 0
    breaks: dict[str, int] = field(default_factory=dict)
    log_file: str | None = None  # where torch's own messages (Dynamo's tracebacks, warnings) went, if any

    def describe(self) -> str:
        """The capture in a few lines, for the console and the logs."""
        what = "forward, backward and optimizer step" if self.scope == "step" else "optimizer step"
        lines = [f"whole-step capture ({self.backend}{', CUDA graphs' if self.cuda_graphs else ''}): {what} "
                 f"in {self.graphs} compiled graph{'s' if self.graphs != 1 else ''}"]
        lines += [f"  graph break x{count}: {reason}" for reason, count in self.breaks.items()]
        lines += [f"  falls back: {reason}" for reason in self.reasons]
        if self.log_file is not None:
            lines.append(f"  torch's messages (Dynamo's tracebacks, warnings): {self.log_file}")
        return "\n".join(lines)


def _uses_fsdp(pm) -> bool:
    from dtmega.passes.results import DataParallelism

    data = pm.result(DataParallelism)
    return data is not None and data.mode in ("fsdp", "hsdp")


class CapturedStep:
    """A training step compiled as one program (see the module docstring)."""

    def __init__(self, pm, optimizer: torch.optim.Optimizer, *, backend: str = "inductor",
                 cuda_graphs: bool | None = None, microbatches: int | None = None, verbose: bool = True,
                 log_file: str | os.PathLike | None = None):
        if backend not in BACKENDS:
            raise PlanError(f"capture_step(backend={backend!r}) is unknown; use one of {BACKENDS}")
        device = pm.mesh.device_type
        if cuda_graphs and device != "cuda":
            raise PlanError(f"capture_step(cuda_graphs=True): CUDA graphs need a GPU; this mesh is on {device}. "
                            "Fix: cuda_graphs=None (used where they can be) or False")
        self.pm, self.optimizer, self.microbatches, self.verbose = pm, optimizer, microbatches, verbose
        scope = "optimizer" if pm.pipelined else "step"
        report = CaptureReport(backend, scope, False)
        if pm.pipelined:
            report.reasons.append("pipeline schedule: stages send and receive per micro-batch, so forward and backward "
                                  "run eagerly (compile the stages' blocks with Compile()); the optimizer step is "
                                  "compiled")
        if any(not isinstance(group["lr"], torch.Tensor) for group in optimizer.param_groups):
            report.reasons.append("the learning rate is a Python float: a schedule that changes it recompiles the "
                                  "optimizer step (give lr as a tensor, torch.tensor(lr), to avoid it)")
        blockers = self._cuda_graph_blockers(pm, backend, device)
        if cuda_graphs is not False and device == "cuda" and blockers:
            if cuda_graphs:
                raise PlanError(f"capture_step(cuda_graphs=True): {blockers[0]}. Fix: cuda_graphs=None or False")
            report.reasons += [f"no CUDA graphs: {reason}" for reason in blockers]
        report.cuda_graphs = cuda_graphs is not False and device == "cuda" and not blockers
        self.report = report
        mode = "reduce-overhead" if report.cuda_graphs else None
        body = self._optimizer_step if scope == "optimizer" else self._device_step
        self._compiled = torch.compile(body, backend=backend, mode=mode)
        self._steps = 0
        # torch's own messages while the step compiles or runs (Dynamo's "won't convert" tracebacks:
        # hundreds of lines per frame under TP) go to this file; the summary names it
        self.messages = TorchMessagesToFile(log_file if log_file is not None else default_log_path("capture_step"))

    @staticmethod
    def _cuda_graph_blockers(pm, backend: str, device: str) -> list[str]:
        """Why this step's graphs cannot be replayed as CUDA graphs (empty: they can)."""
        reasons = []
        if device != "cuda":
            return ["CUDA graphs need a GPU"]
        if backend != "inductor":
            reasons.append(f"CUDA graphs come with the inductor backend, not {backend}")
        if pm.program.family is not None and pm.program.facts.moe is not None:
            reasons.append("mixture of experts: the tokens each expert gets change every step (shapes not static)")
        if pm.pipelined:
            reasons.append("pipeline schedules run eagerly")
        if _uses_fsdp(pm):
            reasons.append("FSDP2 all-gathers and reduce-scatters in its hooks, between graphs")
        return reasons

    def _device_step(self, fields, step, tokens) -> torch.Tensor:
        loss = self.pm.run_step(fields, step, tokens)
        self.optimizer.step()
        self.pm.after_optimizer_step()
        return loss.detach()

    def _optimizer_step(self) -> None:
        self.optimizer.step()

    def __call__(self, batch: TensorDict) -> torch.Tensor:
        """One training step on this rank's `batch`: gradients cleared, forward and backward,
        the optimizer step and the plan's after-step hooks (FP8 scales, expert biases); returns
        the detached global mean loss, as `forward_backward` does."""
        from torch._dynamo.utils import counters

        self.optimizer.zero_grad(set_to_none=True)
        graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
        # trace_autograd_ops: Dynamo traces loss.backward() into the program instead of breaking
        # there; suppress_errors: a frame Dynamo cannot compile runs eagerly (counted as a break)
        with self.messages, torch._dynamo.config.patch(trace_autograd_ops=True, suppress_errors=True):
            if self.report.scope == "optimizer":
                loss = self.pm.forward_backward(batch, microbatches=self.microbatches)
                self._compiled()
                self.pm.after_optimizer_step()
                loss = loss.detach()
            else:
                fields, step, tokens = self.pm.begin_step(batch, self.microbatches)
                loss = self._compiled(fields, step, tokens)
        self._steps += 1
        if self._steps == 1:
            self.report.log_file = str(self.messages.path) if self.messages.written else None
            self.report.graphs = counters["stats"]["unique_graphs"] - graphs
            for reason, count in counters["graph_break"].items():
                if count > breaks.get(reason, 0):
                    first = next((line for line in reason.splitlines() if line.strip()), reason).strip()
                    self.report.breaks[first] = self.report.breaks.get(first, 0) + count - breaks.get(reason, 0)
            if self.verbose:
                from dtmega.printing import console

                if self.pm.program.mesh is None or torch.distributed.get_rank() == 0:
                    console().print(self.report.describe(), markup=False, highlight=False)
        return loss

    def describe(self) -> str:
        """The capture report (graphs, breaks, fallbacks): after the first step."""
        return self.report.describe()

    @property
    def reasons(self) -> list[str]:
        """Why parts of the step are not captured (pipeline schedule, no CUDA graphs, ...)."""
        return self.report.reasons


def capture_step(pm, optimizer: torch.optim.Optimizer, *, backend: str = "inductor", cuda_graphs: bool | None = None,
                 microbatches: int | None = None, verbose: bool = True,
                 log_file: str | os.PathLike | None = None) -> CapturedStep:
    """`pm`'s training step (forward, backward, `optimizer.step()`, the plan's after-step hooks)
    compiled as one program, CUDA graphs where shapes are static: a step without Python's and
    the launcher's overhead between kernels. `cuda_graphs=None` uses them where they can be
    (a GPU, inductor, static shapes), True insists (PlanError where they cannot be), False never.
    The first call compiles and prints what was captured and why anything falls back. Torch's own
    messages meanwhile (Dynamo's graph-break tracebacks, warnings) go to `log_file` (default: one
    file per rank under the temp dir's dtmega/), which the summary names, not to the console."""
    return CapturedStep(pm, optimizer, backend=backend, cuda_graphs=cuda_graphs, microbatches=microbatches,
                        verbose=verbose, log_file=log_file)
