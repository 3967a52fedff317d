"""Measured pipeline bubble of every schedule vs theory, for p = 2, 4 and m = 4, 8, 16.

    python benchmarks/pipeline.py              # table + benchmarks/results/pipeline.json (~2 min)

Each stage is one block whose forward sleeps `t` (--tick, 20 ms) and whose backward sleeps `t` for the input
gradient and `t` for the weight gradient (so a full backward is 2t, as in the theory, and
zero-bubble schedules can move the weight half). Sleeping instead of computing keeps 4 ranks on
2 cores from slowing each other, so the numbers are the schedules' own. The model goes through
dtmega.parallelize + PipelineSplit like any other; busy time is timed around the stages'
forward/backward calls, and the bubble of a rank is 1 - busy / step time.
Theory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved 1F1B.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.table import Table
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, run_worker  # noqa: E402
from dtmega.printing import console  # noqa: E402

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "looped_bfs": 2, "interleaved_zero_bubble": 2,
             "zbv": 2, "dualpipev": 2}
TICK = float(os.environ.get("DTMEGA_BENCH_TICK", "0.02"))  # seconds per stage forward


class _Sleep(torch.autograd.Function):
    """y = x * w, taking TICK per forward, TICK per input-grad and TICK per weight-grad."""

    @staticmethod
    def forward(ctx, x, w):
        time.sleep(TICK)
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            time.sleep(TICK)
            grad_x = grad * w
        if ctx.needs_input_grad[1]:
            time.sleep(TICK)
            grad_w = (grad * x).sum(dim=tuple(range(grad.dim() - 1)))
        return grad_x, grad_w


class SleepBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, position_ids=None):
        return _Sleep.apply(x, self.weight)


class SleepModel(nn.Module):
    """A decoder whose blocks only sleep: embedding, blocks, norm, output like a Llama."""

    def __init__(self, layers: int, dim: int = 8, vocab: int = 16):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): SleepBlock(dim) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, position_ids=None):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def _register_family():
    from dtmega.passes import ModelFacts, ModelFamily, register_family

    register_family(ModelFamily(
        name="sleep-bench", matches=lambda m: isinstance(m, SleepModel),
        describe=lambda m: ModelFacts("sleep-bench", 1, 1, 16, 8, 8, tuple(f"layers.{k}" for k in m.layers),
                                      "tok_embeddings", "output", "norm"),
        tp_rules=(), sp_rules=(), logits=lambda m, t, p: m(t),
    ))


def measure(schedule: str, microbatches: int, steps: int = 3) -> dict:
    """Runs under torchrun: one schedule, one micro-batch count; returns mean bubble over ranks."""
    import dtmega
    from dtmega.passes import PipelineSplit, Plan

    pp = dist.get_world_size()
    v = SCHEDULES[schedule]
    model = SleepModel(layers=pp * v)
    pm = dtmega.parallelize(model, dtmega.make_mesh(pp=pp, dp_shard=1, device_type="cpu"),
                            Plan([PipelineSplit(schedule=schedule, virtual_stages=v, microbatches=microbatches)]))
    runtime = pm.executor
    busy = [0.0]

    def timed(method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start
        return wrapper

    for stage in runtime.stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, timed(getattr(stage, name)))
    batch = dtmega.synthetic_batch(microbatches, 4, 16)
    bubbles = []
    for step in range(steps + 1):
        busy[0] = 0.0
        dist.barrier()
        start = time.perf_counter()
        pm.forward_backward(batch)
        elapsed = time.perf_counter() - start
        if step:  # the first step also infers shapes
            everyone = [None] * pp
            dist.all_gather_object(everyone, 1.0 - busy[0] / elapsed)
            bubbles.append(statistics.mean(everyone))
    return {"bubble": statistics.mean(bubbles)}


def theory(schedule: str, p: int, m: int) -> float | None:
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (SCHEDULES[schedule] * m + p - 1)
    return None


def worker(out: Path, microbatch_counts: list[int]) -> None:
    _register_family()
    rows = []
    for schedule in SCHEDULES:
        for m in microbatch_counts:
            if schedule in ("1f1b", "dualpipev") and m < dist.get_world_size() * SCHEDULES[schedule]:
                continue
            result = measure(schedule, m)
            rows.append({"schedule": schedule, "p": dist.get_world_size(), "m": m, **result,
                         "theory": theory(schedule, dist.get_world_size(), m)})
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pipeline.json")
    parser.add_argument("--tick", type=float, default=TICK, help="seconds a stage forward takes")
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_out:
        run_worker(worker, args.worker_out, args.microbatches)
    rows = []
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for pp in args.pp:
        part = args.out.with_suffix(f".pp{pp}.json")
        command = [torchrun, "--nproc-per-node", str(pp), __file__, "--worker-out", str(part),
                   "--microbatches", *map(str, args.microbatches)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DTMEGA_BENCH_TICK": str(args.tick)}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode:
            raise RuntimeError(done.stderr[-3000:])
        rows += json.loads(part.read_text())
        part.unlink()
    result = {"command": " ".join([sys.executable, *sys.argv]), "machine": machine(), "tick_seconds": args.tick, "runs": rows}
    args.out.write_text(json.dumps(result, indent=2))
    table = Table(title=f"pipeline bubble: measured vs theory (stage forward = backward-input = backward-weight = "
                        f"{args.tick * 1000:.0f} ms)")
    for column in ("schedule", "p", "m", "measured", "theory", "gap"):
        table.add_column(column, justify="right")
    for row in rows:
        gap = "" if row["theory"] is None else f"{(row['bubble'] - row['theory']) * 100:+.1f} pts"
        table.add_row(row["schedule"], str(row["p"]), str(row["m"]), f"{row['bubble']:.3f}",
                      "-" if row["theory"] is None else f"{row['theory']:.3f}", gap)
    console().print(table)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
