"""FuseKernels' measured choice between its Triton kernels and inductor's code for the same ops,
inside blocks compiled on a GPU (kernels/measured_choice.py keeps the answers on disk).

For each in-block op (`rms_norm`, `rms_norm_residual`, `swiglu`, `rope`) at the run's per-rank
shapes (`op_shapes`: tokens of a micro-batch on this rank, the width the op sees), the two
candidates' forward and backward are timed on the device: `triton`, the fused kernel, and
`inductor`, the op's plain PyTorch form compiled by torch.compile, as it runs when the kernel
is left to the compiled block. The faster is kept (the layout keeps the kernel, or gives the
op's modules back to the compiler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from dtmega.passes.program import Program

CANDIDATES = ("triton", "inductor")


@dataclass(frozen=True)
class OpShape:
    """An op's inputs on one rank: `tokens` rows of `width` (RoPE: heads of `head_dim`)."""

    op: str
    tokens: int
    width: int
    heads: int = 0
    kv_heads: int = 0
    dtype: str = "float32"

    def key(self, device: str) -> str:
        """What a measurement holds for."""
        heads = f" H{self.heads}/{self.kv_heads}" if self.heads else ""
        return f"{self.op} T{self.tokens} W{self.width}{heads} {self.dtype} on {device} (torch {torch.__version__})"


def op_shapes(program: Program) -> dict[str, OpShape]:
    """Each in-block op's shape on this rank for the program's workload (empty without one):
    norms on the sequence shard under SP, SwiGLU on this rank's FFN columns, RoPE on its heads."""
    workload = program.workload
    if workload is None:
        return {}
    facts = program.facts
    tp, cp = program.role_size("tensor"), program.role_size("context")
    tokens = workload.micro_batch * workload.seq_len // max(cp, 1)
    sequence_parallel = any(e.style == "sequence_norm" for e in program.layout.modules.values())
    norm_tokens = tokens // tp if sequence_parallel else tokens
    head_dim = facts.head_dim
    dtype = workload.dtype
    return {
        "rms_norm": OpShape("rms_norm", norm_tokens, facts.dim, dtype=dtype),
        "rms_norm_residual": OpShape("rms_norm_residual", norm_tokens, facts.dim, dtype=dtype),
        "swiglu": OpShape("swiglu", tokens, max(1, facts.ffn_dim // tp), dtype=dtype),
        "rope": OpShape("rope", tokens, head_dim, facts.n_heads // tp, max(1, facts.n_kv_heads // tp), dtype=dtype),
    }


def _plain(op: str) -> Callable:
    """The op's unfused PyTorch form (what a compiled block computes when the kernel is not used)."""
    if op == "rms_norm":
        return lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    if op == "rms_norm_residual":
        def add_norm(x, r, w):
            h = x + r
            return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w, h
        return add_norm
    if op == "swiglu":
        return lambda a, b: F.silu(a) * b

    def rotate(x, table):  # RoPE on channel pairs, as the models' apply_rope: [B, S, H, D], table [S, D/2, 2]
        pairs = x.unflatten(-1, (-1, 2))
        cos, sin = table[None, :, None, :, 0], table[None, :, None, :, 1]
        even, odd = pairs[..., 0], pairs[..., 1]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

    return lambda q, k, table: (rotate(q, table), rotate(k, table))


def _fused(op: str) -> Callable:
    """The op through its fused Triton kernel."""
    from dtmega.kernels.rmsnorm import rms_norm, rms_norm_residual
    from dtmega.kernels.rope import apply_rope_qk
    from dtmega.kernels.swiglu import swiglu

    return {"rms_norm": lambda x, w: rms_norm(x, w, 1e-5, impl="triton"),
            "rms_norm_residual": lambda x, r, w: rms_norm_residual(x, r, w, 1e-5, impl="triton"),
            "swiglu": lambda a, b: swiglu(a, b, impl="triton"),
            "rope": lambda q, k, table: apply_rope_qk(q, k, table, None, impl="triton")}[op]


def device_op_timer(shape: OpShape, device: torch.device) -> Callable[[str], float]:
    """Seconds per forward + backward of `shape.op` by each candidate on `device`."""
    from dtmega.kernels.measured_choice import device_timer

    dtype = getattr(torch, shape.dtype)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=device, dtype=dtype, requires_grad=True)

    def inputs() -> tuple:
        if shape.op == "rope":
            seq = shape.tokens
            frequencies = 10000.0 ** (-torch.arange(0, shape.width, 2, device=device).float() / shape.width)
            angles = torch.arange(seq, device=device).float()[:, None] * frequencies[None]
            table = torch.stack([angles.cos(), angles.sin()], dim=-1)  # [S, D/2, 2], as the models' RoPE table
            return randn(1, seq, shape.heads, shape.width), randn(1, seq, shape.kv_heads, shape.width), table
        if shape.op == "rms_norm_residual":
            return randn(shape.tokens, shape.width), randn(shape.tokens, shape.width), randn(shape.width)
        if shape.op == "rms_norm":
            return randn(shape.tokens, shape.width), randn(shape.width)
        return randn(shape.tokens, shape.width), randn(shape.tokens, shape.width)

    def timer(candidate: str) -> float:
        fn = _fused(shape.op) if candidate == "triton" else torch.compile(_plain(shape.op))
        args = inputs()

        def run() -> None:
            out = fn(*args)
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward([o for o in outs if o.requires_grad], [torch.ones_like(o) for o in outs
                                                                            if o.requires_grad])

        return device_timer(run, device.type)

    return timer
