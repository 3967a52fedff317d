"""The attention kernel as a plan decision (Megatron's --attention-backend).

`AttentionBackend(backend)` gives every block's causal attention core one kernel of
kernels/attention_backends.py: forced (`flash`, `cudnn`, `efficient`, `math`, `flex`, or
Megatron's names `flash`, `fused` (= cuDNN's fused attention), `unfused`/`local` (= the unfused
math)), or `auto`: the fastest for this run's per-rank shapes (micro-batch, sequence shard,
this rank's heads, head dims), dtype and mask on this device, measured once (forward and
backward of each candidate) and kept on disk (kernels/measured_choice.py), so the next run
reads the answer. Where nothing can be measured (no CUDA device in `apply`'s place, no
workload to take shapes from) and no `timer` is given, `auto` leaves the choice to torch's
scaled_dot_product_attention, and says so. The choice is written into the layout (the core's
kernel, shown by the report) and the plan's notes, with every candidate's time.

Attention cores another pass gave a kernel keep it (context parallelism's ring, all-gather and
all-to-all attention, packed documents' masks, selective recompute's op): the note names them.
Decoding with a KV cache (an offset or per-row lengths) and document masks take the plain path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dtmega.kernels.attention_backends import BACKENDS, MEGATRON_BACKENDS, PREFERENCE, available, causal_attention
from dtmega.kernels.measured_choice import MeasuredChoice, device_timer
from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.program import Program
from dtmega.passes.slots import refuse_dropping_cores, swap_module


@dataclass(frozen=True)
class AttentionShape:
    """One rank's causal attention: batch, sequence, query and key/value heads, head dims, dtype."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    dtype: str

    def key(self, device: str) -> str:
        """What a measurement holds for: the shapes, dtype, mask, device and torch's version."""
        return (f"causal B{self.batch} S{self.seq} H{self.heads}/{self.kv_heads} D{self.qk_dim}/{self.v_dim} "
                f"{self.dtype} on {device} (torch {torch.__version__})")


def attention_shape(program: Program) -> AttentionShape | None:
    """This rank's attention shape from the workload and the model's facts (None without a
    workload): heads split by tensor parallelism, the sequence by context parallelism."""
    workload = program.workload
    if workload is None:
        return None
    facts = program.facts
    tp, cp = program.role_size("tensor"), program.role_size("context")
    latent = facts.latent_attention
    head_dim = facts.head_dim
    qk = latent.qk_nope_head_dim + latent.qk_rope_head_dim if latent else head_dim
    v = latent.v_head_dim if latent else head_dim
    return AttentionShape(workload.micro_batch, workload.seq_len // max(cp, 1), facts.n_heads // tp,
                          max(1, facts.n_kv_heads // tp), qk, v, workload.dtype)


def device_attention_timer(shape: AttentionShape, device: torch.device) -> Callable[[str], float]:
    """Seconds per forward + backward of each candidate on `device` at `shape`."""
    dtype = getattr(torch, shape.dtype)

    def timer(backend: str) -> float:
        def tensor(heads: int, dim: int) -> torch.Tensor:
            return torch.randn(shape.batch, shape.seq, heads, dim, device=device, dtype=dtype, requires_grad=True)

        q, k, v = tensor(shape.heads, shape.qk_dim), tensor(shape.kv_heads, shape.qk_dim), tensor(shape.kv_heads,
                                                                                                   shape.v_dim)
        grad = torch.randn(shape.batch, shape.seq, shape.heads, shape.v_dim, device=device, dtype=dtype)

        def run() -> None:
            causal_attention(backend, q, k, v).backward(grad)

        return device_timer(run, device.type)

    return timer


@dataclass
class AttentionBackend(Pass):
    """Every block's causal attention core through one kernel, forced or measured (module
    docstring). `timer(candidate) -> seconds` replaces the measurement (tests: a fake timer);
    `cache`: the file of measured choices (None: $DTMEGA_CACHE_DIR/kernel_choices.json)."""

    backend: str = "auto"
    timer: Callable[[str], float] | None = None
    cache: str | None = None

    provides = ("attention_backend",)
    # cores that context parallelism, packed documents or selective recompute gave a kernel keep it
    after = ("context_parallel@*", "recompute", "document_masking")

    def _candidate(self) -> str:
        name = MEGATRON_BACKENDS.get(self.backend, self.backend)
        if name != "auto" and name not in BACKENDS:
            raise PlanError(f"AttentionBackend({self.backend!r}) is unknown. Fix: one of auto, "
                            f"{', '.join(BACKENDS)} (or Megatron's {', '.join(MEGATRON_BACKENDS)})")
        return name

    def annotate(self, program: Program) -> None:
        name = self._candidate()
        family = program.family
        if family is None or family.attention_core is None:
            raise PlanError("AttentionBackend chooses the kernel of the family's attention core, and this model's "
                            "family names none. Fix: leave AttentionBackend out (torch picks the kernel)")
        # annotation only (check_plan, a dry run for another machine): the device is not known, and
        # the kernel registry checks the choice against the real one when the plan is applied
        device = program.mesh.device_type if program.mesh is not None else None
        cores = [f"{block}.{family.attention_core}" for block in program.blocks()]
        cores = [fqn for fqn in cores if fqn in program.layout]
        taken = [fqn for fqn in cores if program.layout[fqn].kernel not in (None, "attention.sdpa")]
        free = [fqn for fqn in cores if fqn not in taken]
        if name != "auto" and device is not None and not available(name, device):
            raise PlanError(f"AttentionBackend({self.backend!r}): the {name} kernel runs on "
                            f"{'/'.join(BACKENDS[name])}, not {device}. Fix: --attention-backend auto, or one of "
                            f"{', '.join(b for b in BACKENDS if available(b, device))}")
        latent = program.facts.latent_attention
        if name == "flash" and latent is not None and latent.v_head_dim != latent.qk_nope_head_dim + latent.qk_rope_head_dim:
            raise PlanError(f"AttentionBackend({self.backend!r}): FlashAttention needs the value heads as wide as the "
                            f"query/key heads; this model's are {latent.v_head_dim} and "
                            f"{latent.qk_nope_head_dim + latent.qk_rope_head_dim} wide. Fix: --attention-backend fused, "
                            "unfused or auto")
        if name not in ("auto", "math"):
            refuse_dropping_cores(program, free, f"AttentionBackend({self.backend!r})",
                                  "--attention-backend unfused (plain math, which drops as Megatron's unfused "
                                  "attention does), auto (the core keeps its own attention), or --attention-dropout 0")
        dropping = [fqn for fqn in free if float(getattr(program.modules.get(fqn), "attention_dropout_p", 0) or 0) > 0]
        if dropping and name == "math":  # Megatron's unfused attention: the core's own dropped path is that math
            program.note(f"AttentionBackend({self.backend!r}): {len(dropping)} attention cores drop attention "
                         "probabilities in training: they compute them in plain math, as Megatron's unfused attention "
                         "does (the math kernel where nothing is dropped)")
        elif dropping:
            program.note(f"AttentionBackend(auto): {len(dropping)} attention cores drop attention probabilities in "
                         "training and keep their own attention (SDPA where nothing is dropped)")
            free = [fqn for fqn in free if fqn not in dropping]
        chosen = name if name != "auto" else self._measured(program, device)
        if chosen is not None:
            for fqn in free:
                program.layout[fqn].kernel = _kernel_name(chosen)
        if taken:
            kinds = sorted({program.layout[fqn].kernel for fqn in taken})
            program.note(f"AttentionBackend: {len(taken)} attention cores keep the kernel another pass chose "
                         f"({', '.join(kinds)})")

    def _measured(self, program: Program, device: str) -> str | None:
        shape = attention_shape(program)
        timer = self.timer
        if timer is None and device == "cuda" and shape is not None and torch.cuda.is_available():
            timer = device_attention_timer(shape, torch.device("cuda", torch.cuda.current_device()))
        if timer is None or shape is None:
            why = "no workload gives the shapes" if shape is None else f"nothing to measure on ({device})"
            program.note(f"AttentionBackend(auto): torch's scaled_dot_product_attention picks the kernel ({why})")
            return None
        name = device or "the planning machine"
        if device == "cuda" and torch.cuda.is_available():
            name = torch.cuda.get_device_name()
        candidates = [b for b in PREFERENCE if device is None or available(b, device)]
        chooser = MeasuredChoice("attention", self.cache, preference=PREFERENCE)
        try:
            choice = chooser.choose(shape.key(name), candidates, timer)
        except ValueError as error:
            raise PlanError(f"AttentionBackend(auto): {error}. Fix: --attention-backend auto on a device torch's "
                            "attention kernels support") from None
        program.note(f"AttentionBackend(auto) for {shape.key(name)}: {choice.describe()}")
        return choice.chosen

    def apply(self, program: Program) -> None:
        for fqn, entry in program.layout.modules.items():
            backend = _backend_of(entry.kernel)
            if backend is None:
                continue
            swap_module(program, fqn, lambda core, backend=backend: BackendCore(core, backend), "AttentionBackend")


def _kernel_name(backend: str) -> str:
    return "attention.flex" if backend == "flex" else f"attention.sdpa.{backend}"


def _backend_of(kernel: str | None) -> str | None:
    if kernel == "attention.flex":
        return "flex"
    if kernel and kernel.startswith("attention.sdpa."):
        return kernel.rpartition(".")[2]
    return None


class BackendCore(nn.Module):
    """The attention core whose causal training path runs `backend`'s kernel; decoding and
    document masks go to the core itself."""

    def __init__(self, inner: nn.Module, backend: str):
        super().__init__()
        self.inner, self.backend = inner, backend

    def forward(self, q, k, v, q_offset=0, documents=None, **dropout):
        # `dropout` (keys=, head_offset=): a GPT core's plan-independent dropout. A core that drops
        # in training computes its probabilities itself, in plain math; annotate allows that only
        # for the math backend (Megatron's unfused), so no other choice is silently replaced.
        drops = (dropout.get("keys") is not None and self.inner.training
                 and float(getattr(self.inner, "attention_dropout_p", 0) or 0) > 0)
        if documents is not None or isinstance(q_offset, torch.Tensor) or q_offset or drops:
            return self.inner(q, k, v, q_offset=q_offset, documents=documents, **dropout)
        return causal_attention(self.backend, q, k, v)
