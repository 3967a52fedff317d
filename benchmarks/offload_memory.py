"""Device memory saved by `--cpu-optimizer` (FSDP2's CPU offload of weights, gradients and Adam
state), measured (the planner issue's item 5: docs/planning.md holds the prediction).

    python benchmarks/offload_memory.py            # one GPU: the 1.5 B Llama, 10 steps each way
    python benchmarks/offload_memory.py --tiny     # a tiny model on the CPU (checks the script;
                                                   # the CPU's "memory" is the process's RSS)

Two runs of `dtmega train` on the demo corpus (make runs/demo/data/kjv_text_document.idx):
without and with `--cpu-optimizer`, the same model, batch and seed; each rank's peak device
memory is the trainer's `memory_gib` (torch.cuda.max_memory_allocated), its largest logged
value. JSON: --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

from benchmarks.common import machine, run_measured  # noqa: E402
from benchmarks.fp8_training import DATA, SIZES  # noqa: E402

TINY = ["--swiglu", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--tensor-model-parallel-size", "1"]


def run(flags: list[str], tmp: Path, name: str, args) -> float:
    """Peak memory (GiB) of one rank over a short run with `flags`."""
    log = tmp / f"{name}.jsonl"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    size = TINY if args.tiny else [*SIZES["1.5b"]["flags"], "--bf16"]
    command = [torchrun, "--nproc-per-node", "1", "-m", "dtmega", "train", "--config", str(ROOT / "configs" / "demo.toml"),
               *size, "--train-iters", str(args.steps), "--log-interval", "1", "--eval-iters", "0",
               "--eval-interval", str(args.steps), "--lr-warmup-iters", "1", "--data-path", str(args.data_path),
               "--log-file", str(log), "--use-distributed-optimizer", *flags]
    done, _, _ = run_measured(command, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return max(row["memory_gib"] for row in rows if "memory_gib" in row)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--data-path", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "offload_memory.json")
    args = parser.parse_args(argv)
    if not Path(f"{args.data_path}.idx").exists():
        parser.error(f"{args.data_path}.idx is missing: run `make {DATA}.idx` in the repository first")
    with tempfile.TemporaryDirectory() as tmp:
        without = run([], Path(tmp), "without", args)
        with_offload = run(["--cpu-optimizer"], Path(tmp), "cpu-optimizer", args)
    result = {"command": " ".join(sys.argv), "machine": machine(), "steps": args.steps, "tiny": args.tiny,
              "peak_gib_without": without, "peak_gib_cpu_optimizer": with_offload, "saved_gib": without - with_offload}
    print(f"peak device memory: {without:.2f} GiB without --cpu-optimizer, {with_offload:.2f} GiB with it "
          f"(saved {without - with_offload:.2f} GiB)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
