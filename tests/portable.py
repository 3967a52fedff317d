"""Runs the distributed session under each CPU kernel level torch can use on this machine.

    make test-portable        (or: .venv/bin/python tests/portable.py [default avx2 native])

torch picks its CPU kernels by instruction set (ATEN_CPU_CAPABILITY=default|avx2|avx512;
unset = the best this CPU has). Reduction orders and bf16 rounding differ between them, so a
tolerance that only holds for one CPU's kernels fails on another machine of the same kind. CI
runs `make test` once, natively; this runs the session once per level and prints one summary
line each, with its wall time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distributed_session import crash_stacks

ROOT = Path(__file__).resolve().parents[1]
LEVELS = ("default", "avx2", "native")


def capability(env: dict[str, str]) -> str:
    """The kernel level torch actually uses under `env` (it falls back to what the CPU has)."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip()


def run(level: str) -> tuple[str, str, float, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if level != "native":
        env["ATEN_CPU_CAPABILITY"] = level
    used = capability(env)
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "4",
        "--local-ranks-filter", "0",
               "-m", "pytest", "tests/distributed", "-q", "-p", "no:cacheprovider"]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dtmega-portable-") as crash_dir:
        env["DTMEGA_TEST_CRASH_DIR"] = crash_dir
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        stacks = crash_stacks(Path(crash_dir))  # a rank that died of a signal: faulthandler's stacks
    seconds = time.monotonic() - start
    lines = [line for line in done.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    summary = lines[-1].strip("= ") if lines else f"no pytest summary (exit {done.returncode})"
    if done.returncode:
        print(done.stdout[-6000:], done.stderr[-3000:], sep="\n")
        for rank, text in stacks.items():
            print(f"===== {rank} died of a signal =====\n{text[:8000]}")
    return used, summary, seconds, done.returncode


def main(levels: list[str]) -> int:
    results = []
    for level in levels:
        print(f"ATEN_CPU_CAPABILITY={level}: running the distributed session ...", flush=True)
        used, summary, seconds, code = run(level)
        print(f"  {level} (torch uses {used}): {summary} [{seconds:.0f} s]", flush=True)
        results.append(code)
    return max(results, default=0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(LEVELS)))
