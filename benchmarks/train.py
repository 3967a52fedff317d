"""Training throughput and MFU by plan, on 4 CPU ranks (or GPUs), through `dtmega train`.

    python benchmarks/train.py                     # table + benchmarks/results/train.json

Each plan trains the same model on the same synthetic corpus for a few steps under torchrun;
the numbers are the trainer's own metrics.jsonl (tokens/s, TFLOP/s per device, MFU against the
peak it states). Compare plans with each other within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, run_measured  # noqa: E402
from benchmarks.preprocess import synthetic_jsonl  # noqa: E402
from dtmega.printing import console  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "768", "--num-attention-heads", "8",
         "--group-query-attention", "--num-query-groups", "4", "--swiglu", "--seq-length", "256",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--untie-embeddings-and-output-weights"]
PLANS = {
    "DDP4": [],
    "FSDP4": ["--use-distributed-optimizer"],
    "TP2 x FSDP2 (+SP)": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"],
    "TP4 (+SP)": ["--tensor-model-parallel-size", "4", "--sequence-parallel"],
    "TP2 x DDP2 + full recompute": ["--tensor-model-parallel-size", "2", "--recompute-granularity", "full"],
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--max-plans", type=int, default=len(PLANS), help="run only the first N plans of the table")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "train.json")
    args = parser.parse_args(argv)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source = synthetic_jsonl(tmp / "corpus.jsonl", size_mb=5)
        prep = [sys.executable, "-m", "dtmega", "preprocess", "--input", str(source), "--output-prefix",
                str(tmp / "corpus"), "--tokenizer-type", "byte", "--append-eod", "--no-progress"]
        done, _, _ = run_measured(prep, cwd=ROOT)
        if done.returncode:
            raise RuntimeError(done.stderr)
        for name, flags in list(PLANS.items())[:args.max_plans]:
            log = tmp / f"{len(rows)}.jsonl"
            command = [torchrun, "--nproc-per-node", str(args.nproc), "-m", "dtmega", "train", *MODEL, *flags,
                       "--train-iters", str(args.steps), "--log-interval", str(args.steps // 2), "--eval-iters", "0",
                       "--data-path", str(tmp / "corpus_text_document"), "--tokenizer-type", "byte", "--log-file", str(log)]
            done, seconds, peak = run_measured(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if done.returncode:
                raise RuntimeError(f"{name}: {done.stderr[-3000:]}")
            last = json.loads(log.read_text().splitlines()[-1])  # the second half: warm, compiled caches filled
            rows[name] = {**{k: last[k] for k in ("tokens_per_s", "tflops_per_device", "mfu", "memory_gib")},
                          "wall_seconds": seconds, "peak_rss_all_ranks_gib": peak / 2**30}
    result = {"command": " ".join([sys.executable, *sys.argv]), "machine": machine(), "model_flags": MODEL,
              "ranks": args.nproc, "steps": args.steps, "plans": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    table = Table(title=f"dtmega train on {args.nproc} ranks ({args.steps} steps; metrics of the last {args.steps // 2})")
    for column in ("plan", "tokens/s", "TFLOP/s per device", "MFU", "peak memory per rank (GiB)"):
        table.add_column(column, justify="right")
    for name, row in rows.items():
        table.add_row(name, f"{row['tokens_per_s']:,.0f}", f"{row['tflops_per_device']:.4f}",
                      f"{row['mfu']:.3f}" if row["mfu"] is not None else "-", f"{row['memory_gib']:.2f}")
    console().print(table)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
