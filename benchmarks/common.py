"""Shared by the benchmarks: what machine, how much memory a process tree used, what autograd
saves, and timed steps with the bytes they sent."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch


def machine() -> dict:
    """What the numbers were measured on."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


def _tree_rss_bytes(pid: int) -> int:
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration, PermissionError):
            continue
    return total


def run_measured(command: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, float, int]:
    """Runs `command`; returns (result, seconds, peak RSS in bytes summed over it and its children)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    peak = [0]

    def poll():
        while process.poll() is None:
            peak[0] = max(peak[0], _tree_rss_bytes(process.pid))
            time.sleep(0.05)

    watcher = threading.Thread(target=poll, daemon=True)
    start = time.perf_counter()
    watcher.start()
    out, err = process.communicate()
    seconds = time.perf_counter() - start
    watcher.join()
    return subprocess.CompletedProcess(command, process.returncode, out, err), seconds, peak[0]


def run_worker(worker, *args) -> None:
    """Runs `worker(*args)` as one rank of a `run_on_ranks` job and ends the process.

    The ranks meet at a barrier, the process group is destroyed, and the process leaves with
    `os._exit(0)`: interpreter finalization is skipped because a gloo rank that finished could
    still abort there ("terminate called without an active exception", SIGABRT: rare, but it
    failed a CI run of benchmarks/moe.py), failing a benchmark whose results were already
    written. Nothing is lost: the worker's JSON is written and stdio flushed first."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    worker(*args)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(script: str, ranks: int, out: Path, *args: str) -> list:
    """Runs `script --worker-out OUT ARGS` as a torchrun job of `ranks` CPU ranks and returns
    the JSON rows its rank 0 wrote to OUT."""
    import json

    command = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(ranks), script,
               "--worker-out", str(out), *args]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    rows = json.loads(out.read_text())
    out.unlink()
    return rows


def saved_activation_bytes(run) -> tuple[int, object]:
    """(bytes autograd keeps for backward while `run()` builds the graph, `run()`'s result)."""
    seen, total = set(), [0]

    def pack(tensor):
        if type(tensor) is not torch.Tensor and hasattr(tensor, "elem"):  # an in-flight collective's result
            tensor = tensor.elem
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total[0] += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    return total[0], result


def timed_steps(step, stats, count: int) -> tuple[list[float], list[int]]:
    """Runs `step()` `count` times, ranks in step; returns each run's seconds and the bytes the
    pass's communication `stats` (a CommStats, or None: nothing sent) counted during it."""
    import torch.distributed as dist

    times, sent = [], []
    for _ in range(count):
        before = stats.bytes_sent if stats else 0
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        sent.append((stats.bytes_sent if stats else 0) - before)
    return times, sent
