"""One GPU, one model, every system set up as its maintainers say: tokens/s with spreads.

    python benchmarks/gpu_step.py --phase sweep --systems plain plain+liger   # best micro-batch per system
    python benchmarks/gpu_step.py --phase final --systems plain plain+liger   # 5 repeats, fresh processes
    python benchmarks/gpu_step.py --phase table                               # merge every run: table + JSON
    python benchmarks/gpu_step.py --tiny --phase all                          # the logic, on the CPU

The systems and how each peer is called are in benchmarks/step_systems.py (Liger outside
autocast on bf16 tensors; torchao's recipe configs and its own module filter; torchtitan's
model, float8 converter and compile). Llama 1.50 B (dim 2048, 16 blocks, 32/8 heads, FFN 8192,
vocab 128256 untied), seq 2048, bf16 compute, fp32 master weights, AdamW.

Method (what a ratio needs before it is claimed):
  sweep   each system (each float8 recipe) at micro-batch 4, 8, 12 and 16 in one process under
          one memory cap for all (`torch.cuda.set_per_process_memory_fraction`, 75 GiB on an
          80 GB card), ascending until one does not fit; the fastest micro-batch (and recipe)
          is the system's final configuration
  final   each final configuration --repeats times (>= 5), every repeat a fresh process, all
          repeats of all systems in one shuffled order (the seed is recorded); CUDA-event timing
          of --steps steps (>= 30) after --warmup (>= 5); a fresh random batch every step
  table   median tokens/s with min-max, MFU by the project's formula (6 x (N - V·d) + 12·L·d·S
          FLOPs per token, against 989 TFLOP/s dense bf16 for H100 and H200), peak memory; dtmega
          against the best peer stack of the same precision, a ratio of medians, claimed ahead
          or behind only where the runs' ranges do not overlap

Every run is one JSON file under --results; a phase may be run in pieces (--systems), each
under the lent machine's per-command limit, and `--phase table` merges them all. The JSON
records the command, versions (torch, triton, liger, torchao, torchtitan), the dtmega commit,
the GPU and its clocks and temperature before and after each run (nvidia-smi).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# Appended, not prepended: where dtmega is installed as a wheel (a GPU machine), the source
# tree's dtmega/ (without passes/ and kernels/, which the wheel nests) must not shadow it.
sys.path.append(str(ROOT))

from benchmarks.common import machine  # noqa: E402
from benchmarks.step_systems import SYSTEMS, System, build, model_config  # noqa: E402

PEAK = 989e12  # dense bf16 FLOP/s of an H100 / H200 SXM
MICRO_BATCHES = (4, 8, 12, 16)
PACKAGES = ("torch", "triton", "liger_kernel", "torchao", "torchtitan")


# ---- facts recorded with every run ------------------------------------------------------------
def versions() -> dict:
    """Installed versions of everything a system uses, and the dtmega commit."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in PACKAGES:
        try:
            found[package] = version(package.replace("_", "-"))
        except PackageNotFoundError:
            found[package] = None
    try:
        found["dtmega_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        found["dtmega_commit"] = None
    return found


def gpu_state() -> dict | None:
    """Clocks, temperature and power of the GPU now (None where nvidia-smi does not answer)."""
    fields = "name,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw,memory.total"
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    return dict(zip(fields.split(","), (v.strip() for v in done.stdout.splitlines()[0].split(","))))


def flops_per_token(config, seq: int) -> float:
    """The project's MFU numerator: 6 x (N - V·d) + 12·L·d·S (the input lookup costs nothing)."""
    from dtmega.models.llama.specs import llama_flops_per_token

    return llama_flops_per_token(config, seq)


# ---- one process: time a system ---------------------------------------------------------------
def time_steps(step, *, micro_batch: int, seq: int, vocab: int, steps: int, warmup: int, device: str,
               seed: int) -> dict:
    """Runs `warmup` then `steps` steps, each on a fresh random batch made beforehand; per-step
    times from CUDA events (perf_counter on the CPU)."""
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, vocab, (micro_batch, seq + 1), generator=generator).to(device)
               for _ in range(warmup + steps)]
    for tokens in batches[:warmup]:
        step(tokens[:, :-1], tokens[:, 1:])
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    times, loss = [], None
    for index, tokens in enumerate(batches[warmup:]):
        if device == "cuda":
            events[index][0].record()
            loss = step(tokens[:, :-1], tokens[:, 1:])
            events[index][1].record()
        else:
            start = time.perf_counter()
            loss = step(tokens[:, :-1], tokens[:, 1:])
            times.append(time.perf_counter() - start)
    if device == "cuda":
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    seconds = sum(times)
    return {"micro_batch": micro_batch, "steps": steps, "warmup": warmup, "step_s": times,
            "tokens_per_s": micro_batch * seq * steps / seconds, "loss": float(loss),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}


def _out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def worker(args: argparse.Namespace) -> None:
    """One process: build one system (one recipe) and time it at each asked micro-batch."""
    from dtmega.mesh import default_device_type, init_distributed

    device = default_device_type()
    init_distributed(device)
    torch._dynamo.config.automatic_dynamic_shapes = False  # each micro-batch compiles static, as a run of its own
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    cap = None
    if device == "cuda" and args.memory_cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        cap = min(1.0, args.memory_cap_gib * 2**30 / total)
        torch.cuda.set_per_process_memory_fraction(cap)
    system = SYSTEMS[args.worker]
    config = model_config(args.tiny)
    seq = 64 if args.tiny else 2048
    before = gpu_state()
    setup = build(system, args.recipe, config, device, args.backend)
    rows = []
    for micro_batch in args.micro_batches:
        try:
            row = time_steps(setup.step, micro_batch=micro_batch, seq=seq, vocab=config.vocab_size, steps=args.steps,
                             warmup=args.warmup, device=device, seed=args.seed)
        except Exception as error:  # noqa: BLE001 - out of memory ends the ascending sweep; anything else is reported
            if not _out_of_memory(error):
                raise
            rows.append({"micro_batch": micro_batch, "out_of_memory": True})
            break
        row["mfu"] = flops_per_token(config, seq) * row["tokens_per_s"] / PEAK
        rows.append(row)
    record = {"system": system.name, "recipe": args.recipe, "phase": args.phase, "repeat": args.repeat,
              "order": args.order, "rows": rows, "notes": setup.notes, "device": device,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "memory_cap_fraction": cap,
              "gpu_before": before, "gpu_after": gpu_state(), "versions": versions(), "machine": machine(),
              "seq": seq, "tiny": args.tiny, "command": " ".join(sys.argv)}
    args.worker_out.write_text(json.dumps(record, indent=1))


# ---- the driver -------------------------------------------------------------------------------
def run_file(results: Path, phase: str, system: str, recipe: str | None, repeat: int | None) -> Path:
    """Where one run's JSON goes."""
    parts = [phase, system.replace("+", "_"), recipe or "bf16"] + ([f"r{repeat}"] if repeat is not None else [])
    return results / ("-".join(parts) + ".json")


def launch(args: argparse.Namespace, system: str, recipe: str | None, micro_batches: list[int], phase: str,
           repeat: int | None, order: int | None) -> dict:
    """Runs one worker in a fresh process (`torchrun --nproc-per-node 1`); its record or the error."""
    out = run_file(args.results, phase, system, recipe, repeat)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "1",
               str(Path(__file__).resolve()), "--worker", system, "--worker-out", str(out), "--phase", phase,
               "--micro-batches", *map(str, micro_batches), "--steps", str(args.steps if phase == "final" else
                                                                            args.sweep_steps),
               "--warmup", str(args.warmup), "--backend", args.backend, "--seed", str(args.seed),
               "--memory-cap-gib", str(args.memory_cap_gib), *(["--recipe", recipe] if recipe else []),
               *(["--repeat", str(repeat), "--order", str(order)] if repeat is not None else []),
               *(["--tiny"] if args.tiny else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(ROOT))))}
    if args.tiny and SYSTEMS[system].liger:
        env["TRITON_INTERPRET"] = "1"  # Liger's Triton kernels on CPU tensors
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        record = {"system": system, "recipe": recipe, "phase": phase, "repeat": repeat,
                  "error": f"timed out after {args.timeout} s"}
    else:
        if done.returncode == 0 and out.exists():
            return json.loads(out.read_text())
        lines = [line for line in done.stderr.splitlines() if "Error" in line and "ChildFailedError" not in line]
        record = {"system": system, "recipe": recipe, "phase": phase, "repeat": repeat,
                  "error": "\n".join(lines[-5:]) or done.stderr[-1500:]}
    out.write_text(json.dumps(record, indent=1))
    return record


def run_in_process(args: argparse.Namespace, system: str, recipe: str | None, micro_batches: list[int], phase: str,
                   repeat: int | None, order: int | None) -> dict:
    """`launch` without the fresh process (--in-process: the suite's check of every system on
    the CPU, where a process per run would cost minutes). Never for a measurement."""
    out = run_file(args.results, phase, system, recipe, repeat)
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = args.steps if phase == "final" else args.sweep_steps
    worker(argparse.Namespace(**{**vars(args), "worker": system, "worker_out": out, "recipe": recipe, "phase": phase,
                                 "micro_batches": micro_batches, "steps": steps, "repeat": repeat, "order": order}))
    return json.loads(out.read_text())


def available(system: System) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(package) is not None for package in system.needs)


def chosen_systems(names: list[str]) -> list[System]:
    unknown = [name for name in names if name not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {list(SYSTEMS)}")
    return [SYSTEMS[name] for name in names]


def sweep(args: argparse.Namespace, systems: list[System], run=launch) -> list[dict]:
    """Each system and recipe at every micro-batch (ascending, until one does not fit)."""
    return [run(args, system.name, recipe, list(args.micro_batches), "sweep", None, None)
            for system in systems for recipe in system.recipes]


def best_configurations(records: list[dict]) -> dict[str, tuple[str | None, int, float]]:
    """system -> (recipe, micro-batch, tokens/s) of its fastest swept configuration."""
    best: dict[str, tuple[str | None, int, float]] = {}
    for record in records:
        if record.get("phase") != "sweep" or "rows" not in record:
            continue
        for row in record["rows"]:
            if "tokens_per_s" in row and row["tokens_per_s"] > best.get(record["system"], (None, 0, 0.0))[2]:
                best[record["system"]] = (record["recipe"], row["micro_batch"], row["tokens_per_s"])
    return best


def final_order(best: dict[str, tuple[str | None, int, float]], repeats: int, seed: int) -> list[tuple[str, int]]:
    """(system, repeat) for every repeat of every final configuration, shuffled by `seed`."""
    runs = [(system, repeat) for system in sorted(best) for repeat in range(repeats)]
    random.Random(seed).shuffle(runs)
    return runs


def final(args: argparse.Namespace, systems: list[System], run=launch) -> list[dict]:
    """--repeats fresh processes of each system's best configuration, in one shuffled order."""
    best = best_configurations(load_records(args.results))
    wanted = {s.name for s in systems}
    missing = sorted(wanted - set(best))
    if missing:
        print(f"no sweep result for {missing}: run --phase sweep for them first", file=sys.stderr)
    chosen = {name: best[name] for name in best if name in wanted}
    records = []
    for order, (name, repeat) in chunk_of(final_order(chosen, args.repeats, args.seed), args.chunk):
        recipe, micro_batch, _ = chosen[name]
        records.append(run(args, name, recipe, [micro_batch], "final", repeat, order))
    return records


def chunk_of(order: list, chunk: str | None) -> list[tuple[int, object]]:
    """(position in the whole order, item) of chunk "K/N" (the K-th of N consecutive, nearly
    equal parts; 1-based), or of the whole order: one shuffled order, run in pieces that each fit
    a time limit."""
    numbered = list(enumerate(order))
    if chunk is None:
        return numbered
    k, n = (int(part) for part in chunk.split("/"))
    if not 1 <= k <= n:
        raise SystemExit(f"--chunk {chunk}: K must be in 1..N")
    size, extra = divmod(len(numbered), n)
    start = (k - 1) * size + min(k - 1, extra)
    return numbered[start:start + size + (k <= extra)]


def load_records(results: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(results.glob("*.json")) if path.name != "summary.json"]


# ---- the table --------------------------------------------------------------------------------
def summarize(records: list[dict]) -> dict:
    """Per system: median tokens/s and its range over the final repeats, MFU, memory; then
    dtmega against the best peer stack of each precision, claimed only beyond the spread."""
    finals: dict[str, list[dict]] = {}
    errors = {}
    for record in records:
        if record.get("phase") != "final":
            continue
        if "error" in record:
            errors.setdefault(record["system"], record["error"])
            continue
        row = record["rows"][0]
        if "tokens_per_s" in row:
            finals.setdefault(record["system"], []).append({**row, "recipe": record["recipe"]})
    systems = {}
    for name, rows in finals.items():
        speeds = [r["tokens_per_s"] for r in rows]
        systems[name] = {
            "precision": SYSTEMS[name].precision, "stack": SYSTEMS[name].stack, "recipe": rows[0]["recipe"],
            "micro_batch": rows[0]["micro_batch"], "repeats": len(rows), "median_tokens_per_s": statistics.median(speeds),
            "min_tokens_per_s": min(speeds), "max_tokens_per_s": max(speeds),
            "mfu": statistics.median(r["mfu"] for r in rows),
            "peak_gib": max((r["peak_gib"] for r in rows if r["peak_gib"] is not None), default=None)}
    comparisons = {}
    for precision in ("bf16", "fp8"):
        ours = [n for n, s in systems.items() if s["stack"] == "dtmega" and s["precision"] == precision]
        peers = [n for n, s in systems.items() if s["stack"] != "dtmega" and s["precision"] == precision]
        if not ours or not peers:
            continue
        us = max(ours, key=lambda n: systems[n]["median_tokens_per_s"])
        peer = max(peers, key=lambda n: systems[n]["median_tokens_per_s"])
        a, b = systems[us], systems[peer]
        if a["min_tokens_per_s"] > b["max_tokens_per_s"]:
            verdict = "ahead, beyond the spread"
        elif a["max_tokens_per_s"] < b["min_tokens_per_s"]:
            verdict = "behind, beyond the spread"
        else:
            verdict = "within the spread: no claim"
        comparisons[precision] = {"dtmega": us, "best_peer": peer,
                                  "ratio": a["median_tokens_per_s"] / b["median_tokens_per_s"], "verdict": verdict}
    return {"systems": systems, "comparisons": comparisons, "errors": errors}


def print_table(summary: dict, title: str) -> None:
    from rich.table import Table

    from dtmega.printing import console

    table = Table(title=title)
    for column in ("system", "precision", "recipe", "micro-batch", "repeats", "tokens/s median", "min-max",
                   "MFU", "peak GiB"):
        table.add_column(column, justify="left" if column in ("system", "precision", "recipe") else "right")
    for name, s in sorted(summary["systems"].items(), key=lambda item: (item[1]["precision"], item[0])):
        table.add_row(name, s["precision"], s["recipe"] or "", str(s["micro_batch"]), str(s["repeats"]),
                      f"{s['median_tokens_per_s']:,.0f}", f"{s['min_tokens_per_s']:,.0f}-{s['max_tokens_per_s']:,.0f}",
                      f"{100 * s['mfu']:.1f} %", "" if s["peak_gib"] is None else f"{s['peak_gib']:.1f}")
    console().print(table)
    console().print("MFU: 6 x (N - V·d) + 12·L·d·S FLOPs per token (the input lookup excluded) against 989 TFLOP/s",
                    highlight=False)
    for precision, c in summary["comparisons"].items():
        console().print(f"{precision}: {c['dtmega']} / {c['best_peer']} = {c['ratio']:.3f}x ({c['verdict']})",
                        highlight=False)
    for name, error in summary["errors"].items():
        console().print(f"{name}: error: {error[-300:]}", highlight=False)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=("sweep", "final", "table", "all"), default="all")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), help="which systems (default: all)")
    parser.add_argument("--micro-batches", nargs="+", type=int, default=None,
                        help=f"the sweep (default {' '.join(map(str, MICRO_BATCHES))}; --tiny: 1 2)")
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per final configuration")
    parser.add_argument("--steps", type=int, default=None, help="timed steps of a final run (default 30; --tiny: 3)")
    parser.add_argument("--sweep-steps", type=int, default=None, help="timed steps per sweep point (default 10; --tiny: 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5; --tiny: 1)")
    parser.add_argument("--memory-cap-gib", type=float, default=75.0, help="one memory cap for every system (CUDA)")
    parser.add_argument("--backend", default=None, help="torch.compile backend of the blocks (default inductor; --tiny: eager)")
    parser.add_argument("--seed", type=int, default=0, help="batches and the shuffled order of the final runs")
    parser.add_argument("--chunk", default=None, metavar="K/N",
                        help="final phase: run the K-th of N consecutive parts of the one shuffled order")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the logic, times nothing real")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds one process may take")
    parser.add_argument("--results", type=Path, default=None,
                        help="one JSON per run (default benchmarks/results/gpu_step; --tiny: a new temporary directory)")
    parser.add_argument("--out", type=Path, default=None, help="the merged table's JSON (default RESULTS/summary.json)")
    parser.add_argument("--in-process", action="store_true",
                        help="every run in this process (with --tiny: the suite's check of the logic; never a measurement)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--recipe", help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--order", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tiny = args.tiny
    if args.in_process and not tiny:
        parser.error("--in-process is for --tiny (a measurement runs every repeat in a fresh process)")
    if tiny and args.in_process and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Liger's Triton kernels on CPU tensors
    args.micro_batches = args.micro_batches or ([1, 2] if tiny else list(MICRO_BATCHES))
    args.steps = args.steps or (3 if tiny else 30)
    args.sweep_steps = args.sweep_steps or (2 if tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 5)
    args.backend = args.backend or ("eager" if tiny else "inductor")
    if args.results is None:  # a GPU's runs accumulate across calls; a --tiny check starts clean
        args.results = Path(tempfile.mkdtemp(prefix="gpu_step-tiny-")) if tiny else ROOT / "benchmarks" / "results" / "gpu_step"
    if not tiny and (args.repeats < 5 or args.steps < 30 or args.warmup < 5) and not args.worker:
        print("note: fewer than 5 repeats, 30 timed steps or 5 warm-up steps: not enough to claim a ratio",
              file=sys.stderr)
    if args.worker is None and args.phase != "table":
        args.results.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.worker:
        worker(args)
        return {}
    systems = chosen_systems(args.systems)
    missing = [s.name for s in systems if not available(s)]
    systems = [s for s in systems if available(s)]
    if missing:
        print(f"not run (a package is missing): {', '.join(missing)}", file=sys.stderr)
    run = run_in_process if args.in_process else launch
    if args.phase in ("sweep", "all"):
        sweep(args, systems, run)
    if args.phase in ("final", "all"):
        final(args, systems, run)
    summary = summarize(load_records(args.results))
    summary.update({"command": " ".join(sys.argv), "versions": versions(), "machine": machine(),
                    "not_run": missing, "seed": args.seed})
    out = args.out or args.results / "summary.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print_table(summary, f"one GPU, {'tiny model (CPU: logic only)' if args.tiny else 'Llama 1.50 B, seq 2048'}: "
                         "each system at its best micro-batch")
    return summary


if __name__ == "__main__":
    main()
