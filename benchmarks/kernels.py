"""Each fused kernel at the 1.50 B Llama's real sizes: error against its reference and time.

    python benchmarks/kernels.py            # CUDA: table + benchmarks/results/kernels.json
    python benchmarks/kernels.py --tiny     # CPU: tiny sizes, Triton under TRITON_INTERPRET=1

Sizes (micro-batch 8 x seq 2048 = 16,384 tokens, bf16): RMSNorm and residual-add + RMSNorm over
dim 2048; SwiGLU over FFN 8192; RoPE of q [8, 2048, 32, 64] and k [8, 2048, 8, 64]; the fused
linear cross entropy of hidden [16384, 2048] with an output weight [128256, 2048]. For each, the
Triton kernel's forward output and input gradients against the same op's PyTorch reference
(`impl="reference"`), as the largest relative error over the outputs (||a - b|| / ||b||), and
the time of forward + backward of the Triton kernel, of the reference op (eager) and of the
unfused PyTorch composition under `torch.compile` (what inductor makes of the same math; the
ops themselves are opaque to it). The suite checks these
kernels under the interpreter at small sizes; this is where real sizes and real GPUs show.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch
import torch.nn.functional as F
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

from benchmarks.common import machine
from dtmega.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy_sum
from dtmega.kernels.rmsnorm import rms_norm, rms_norm_residual
from dtmega.kernels.rope import apply_rope_qk
from dtmega.kernels.swiglu import swiglu
from dtmega.models.rope import apply_rope, rope_cache
from dtmega.printing import console


def _cases(tiny: bool, device: str) -> dict:
    """name -> (the op as fn(impl, *inputs), the unfused PyTorch composition as fn(*inputs), inputs)."""
    tokens, dim, ffn, vocab, heads, kv, head_dim = (8 * 2048, 2048, 8192, 128256, 32, 8, 64)
    if tiny:
        tokens, dim, ffn, vocab, heads, kv, head_dim = (37, 48, 96, 500, 4, 2, 16)
    batch = 8 if not tiny else 1
    seq = tokens // batch
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device=device)).to(torch.bfloat16)

    weight = 1 + randn(dim, scale=0.1)
    labels = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    labels[::7] = -100  # masked tokens
    token_weights = (labels != -100).float() / (labels != -100).sum()
    cache = rope_cache(seq, head_dim, 500000.0, None, device=device)

    def plain_norm(x, w):
        return F.rms_norm(x.float(), (x.shape[-1],), w.float(), 1e-5).to(x.dtype)

    def plain_norm_residual(x, r, w):
        h = x + r
        return plain_norm(h, w), h

    def plain_rope(q, k):
        cos_sin = cache[:seq].unsqueeze(0)
        return apply_rope(q, cos_sin).to(q.dtype), apply_rope(k, cos_sin).to(k.dtype)

    def plain_loss(h, w):
        losses = F.cross_entropy((h @ w.T).float(), labels, reduction="none")
        return (losses * token_weights).sum()

    return {
        "rms_norm": (lambda impl, x, w: rms_norm(x, w, 1e-5, impl=impl), plain_norm, [randn(tokens, dim), weight]),
        "rms_norm_residual": (lambda impl, x, r, w: rms_norm_residual(x, r, w, 1e-5, impl=impl),
                              plain_norm_residual, [randn(tokens, dim), randn(tokens, dim), weight]),
        "swiglu": (lambda impl, a, b: swiglu(a, b, impl=impl), lambda a, b: (F.silu(a.float()) * b.float()).to(a.dtype),
                   [randn(tokens, ffn), randn(tokens, ffn)]),
        "rope_qk": (lambda impl, q, k: apply_rope_qk(q, k, cache, impl=impl), plain_rope,
                    [randn(batch, seq, heads, head_dim), randn(batch, seq, kv, head_dim)]),
        "fused_linear_cross_entropy": (
            lambda impl, h, w: fused_linear_cross_entropy_sum(h, w, labels, token_weights, impl=impl), plain_loss,
            [randn(tokens, dim), randn(vocab, dim, scale=0.02)]),
    }


def _run(fn, leaves: list[torch.Tensor], grads_out=None):
    """Outputs and input gradients of fn(*leaves) for output gradients `grads_out` (random if None)."""
    inputs = [t.detach().clone().requires_grad_() for t in leaves]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if grads_out is None:
        gen = torch.Generator(device=outs[0].device).manual_seed(1)
        grads_out = [torch.randn(o.shape, generator=gen, device=o.device).to(o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, inputs, grads_out)
    return [o.detach() for o in outs] + list(grads), grads_out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _time(step, device: str, repeats: int) -> float:
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (Triton interpreted)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kernels.json")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        parser.error("real sizes need a CUDA GPU; on the CPU pass --tiny")
    repeats = 2 if args.tiny else args.repeats
    rows = {}
    for name, (op, plain, leaves) in _cases(args.tiny, device).items():
        steps = {"triton": partial(op, "triton"), "reference": partial(op, "reference"),
                 "compiled": torch.compile(plain, dynamic=False)}
        reference, grads_out = _run(steps["reference"], leaves)
        triton, _ = _run(steps["triton"], leaves, grads_out)
        error = max(_relative(a, b) for a, b in zip(triton, reference))
        times = {k: 1e3 * _time(partial(_run, f, leaves, grads_out), device, repeats) for k, f in steps.items()}
        rows[name] = {"max_rel_error": error, **{f"{k}_ms": v for k, v in times.items()}}
        console().print(f"{name}: {rows[name]}")
    table = Table(title=f"kernels on {device} ({'tiny' if args.tiny else '16,384 tokens, bf16'}): Triton vs the "
                        "reference, forward + backward")
    for column in ("kernel", "max rel. error", "Triton ms", "reference ms", "compiled PyTorch ms", "x compiled"):
        table.add_column(column, justify="left" if column == "kernel" else "right")
    for name, r in rows.items():
        table.add_row(name, f"{r['max_rel_error']:.1e}", f"{r['triton_ms']:.3f}", f"{r['reference_ms']:.3f}",
                      f"{r['compiled_ms']:.3f}", f"{r['compiled_ms'] / r['triton_ms']:.2f}")
    console().print(table)
    result = {"command": " ".join(sys.argv), "machine": machine(),
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
