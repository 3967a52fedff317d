"""Everything that needs a GPU, in one command: `make gpu-check` (or `python benchmarks/gpu_check.py`).

    python benchmarks/gpu_check.py --dry-run        # each step, its command and expected time
    python benchmarks/gpu_check.py                  # all of it, on a lent GPU
    python benchmarks/gpu_check.py --only numerics kernels     # some steps

Each step writes its JSON under docs/measured/ (named for the GPU, e.g. h100-gpu_step.json);
each command is made to finish within the lent machine's 10-minute limit per command, so a
session can run the steps as separate calls and carry `benchmarks/results/` between them (the
gpu_step runs merge into one table). Prerequisites, made on any machine and carried along:
the demo corpus (`make runs/demo/data/kjv_text_document.idx`: `runs/demo/data`) for the FP8
loss curve and the offload measurement, and the peers (liger-kernel, torchao; torchtitan) for
the step table (../shared/gpu/README.md: prepare.sh with extra packages).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))
MEASURED = ROOT / "docs" / "measured"
PY = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STEP = [PY, "benchmarks/gpu_step.py"]
# gpu_step's systems in groups whose sweep (4 micro-batches each, compiled) fits one command
GROUPS = [["plain", "plain+liger"], ["plain+float8"], ["plain+liger+float8"], ["torchtitan", "torchtitan+float8"],
          ["dtmega", "dtmega+kernels"], ["dtmega+fp8"], ["dtmega+kernels+fp8"]]


@dataclass(frozen=True)
class Step:
    """One GPU step: its name, command, expected minutes on an H100, and what it writes."""

    name: str
    command: list[str]
    minutes: float
    writes: str


def gpu_label() -> str:
    """h100, h200, ... (the file prefix of docs/measured), from the device's name."""
    import torch

    if not torch.cuda.is_available():
        return "gpu"
    name = torch.cuda.get_device_name().lower()
    return next((label for label in ("h200", "h100", "b200", "a100", "l40s") if label in name), "gpu")


# Expected minutes on an H100, from the 2026-11-23 runs (one process: ~0.5 min to start and
# build, ~0.7 min to compile 16 blocks with inductor the first time, a step of 8 x 2048 tokens
# ~0.3 s): a swept configuration compiles at four micro-batches; a final run finds its compiled
# blocks in inductor's cache and times 35 steps.
SWEEP_CONFIG_MIN, FINAL_RUN_MIN = 3.4, 0.9
REPEATS, FINAL_CHUNKS = 5, 7


def steps(label: str) -> list[Step]:
    """Every step, in the order they run."""
    from benchmarks.step_systems import SYSTEMS

    plan = [Step(f"sweep {' '.join(group)}", [*STEP, "--phase", "sweep", "--systems", *group],
                 SWEEP_CONFIG_MIN * sum(len(SYSTEMS[name].recipes) for name in group),
                 "benchmarks/results/gpu_step/sweep-*.json") for group in GROUPS]
    finals = len(SYSTEMS) * REPEATS
    plan += [Step(f"final chunk {k}/{FINAL_CHUNKS}", [*STEP, "--phase", "final", "--repeats", str(REPEATS),
                                                     "--chunk", f"{k}/{FINAL_CHUNKS}"],
                  FINAL_RUN_MIN * -(-finals // FINAL_CHUNKS), "benchmarks/results/gpu_step/final-*.json")
             for k in range(1, FINAL_CHUNKS + 1)]
    plan += [
        Step("step table", [*STEP, "--phase", "table", "--out", str(MEASURED / f"{label}-gpu_step.json")], 0.2,
             f"docs/measured/{label}-gpu_step.json"),
        Step("numerics", [PY, "benchmarks/gpu_check.py", "--numerics-to", str(MEASURED / f"{label}-cuda_numerics.json")],
             3.0, f"docs/measured/{label}-cuda_numerics.json"),
        Step("kernels", [PY, "benchmarks/kernels.py", "--out", str(MEASURED / f"{label}-kernels.json")], 4.0,
             f"docs/measured/{label}-kernels.json"),
        Step("fp8 loss curve", [PY, "benchmarks/fp8_training.py", "--size", "1.5b", "--steps", "300", "--warmup", "30",
                                "--precision", "bf16", "--baselines", "bf16", "--out",
                                str(MEASURED / f"{label}-fp8_training.json")], 9.0,
             f"docs/measured/{label}-fp8_training.json"),
        Step("offload memory", [PY, "benchmarks/offload_memory.py", "--out", str(MEASURED / f"{label}-offload_memory.json")],
             4.0, f"docs/measured/{label}-offload_memory.json"),
        Step("step capture", [PY, "benchmarks/step_capture.py", "--device", "cuda", "--seq", "2048", "--batch", "4",
                              "--out", str(MEASURED / f"{label}-step_capture.json")],
             3.0, f"docs/measured/{label}-step_capture.json"),
        Step("packed documents", [PY, "benchmarks/documents.py", "--seq", "8192", "--documents", "8", "--device", "cuda",
                                  "--out", str(MEASURED / f"{label}-documents.json")],
             3.0, f"docs/measured/{label}-documents.json"),
    ]
    return plan


def numerics(out: Path) -> int:
    """tests/gpu/check_cuda_numerics.py under torchrun; its lines and status as JSON."""
    done = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "1", "tests/gpu/check_cuda_numerics.py"],
                          cwd=ROOT, capture_output=True, text=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"returncode": done.returncode, "output": done.stdout.splitlines()[-40:],
                               "errors": done.stderr.splitlines()[-40:]}, indent=1))
    print(done.stdout)
    return done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="list the steps, their commands and expected minutes")
    parser.add_argument("--only", nargs="+", default=None, help="steps whose name starts with one of these words")
    parser.add_argument("--out", type=Path, default=None, help="also write the steps (name, command, minutes) as JSON")
    parser.add_argument("--numerics-to", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.numerics_to:
        return numerics(args.numerics_to)
    label = gpu_label()
    chosen = [s for s in steps(label) if not args.only or any(s.name.startswith(word) for word in args.only)]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([{"name": s.name, "command": s.command, "minutes": s.minutes, "writes": s.writes}
                                        for s in chosen], indent=1))
    if args.dry_run:
        for step in chosen:
            print(f"{step.minutes:5.1f} min  {step.name:<32} {' '.join(step.command[1:])}  -> {step.writes}")
        print(f"{sum(s.minutes for s in chosen):5.1f} min in all ({len(chosen)} steps; expected on one H100, "
              "each step one call under the lent machine's 10-minute limit)")
        return 0
    import torch

    if not torch.cuda.is_available():
        parser.error("no CUDA GPU here: `--dry-run` lists the steps; run them where a GPU is lent")
    failed = []
    for step in chosen:
        start = time.perf_counter()
        status = subprocess.run(step.command, cwd=ROOT).returncode
        print(f"{step.name}: exit {status} after {(time.perf_counter() - start) / 60:.1f} min", flush=True)
        if status:
            failed.append(step.name)
    print("failed: " + ", ".join(failed) if failed else "every step finished")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
