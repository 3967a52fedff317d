"""Framework overhead and multi-rank throughput.

    python benchmarks/overhead.py                 # both parts; table + benchmarks/results/overhead.json

Part 1 (one rank): step time (forward + backward) of the plain model against
`parallelize(model, mesh, Plan([]))`, same weights and batches, interleaved to share noise.
Part 2 (4 ranks, launched with torchrun): tokens/s of TP2 x FSDP2 (with sequence parallelism)
and of FSDP4 on the same model and global batch. Ratios, not absolute numbers, are the result:
they come from one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dtmega  # noqa: E402
from dtmega.kernels import per_token_cross_entropy  # noqa: E402
from dtmega.models import Llama, LlamaConfig  # noqa: E402
from dtmega.passes import DataParallel, Plan, SequenceParallel, TensorParallel  # noqa: E402
from dtmega.printing import console  # noqa: E402

CONFIG = LlamaConfig.from_name("debug", dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=4096)
BATCH, SEQ = 8, 256


def machine() -> dict:
    """What the numbers were measured on."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


def plain_step(model: Llama, batch) -> None:
    logits = model(batch["tokens"])
    (per_token_cross_entropy(logits, batch["labels"]).mean()).backward()


def one_rank_overhead(steps: int) -> dict:
    """Median step time of the plain model and of the empty plan, interleaved."""
    plain = Llama(CONFIG)
    plain.init_weights(seed=0)
    with torch.device("meta"):
        sharded = Llama(CONFIG)
    pm = dtmega.parallelize(sharded, dtmega.make_mesh(device_type="cpu"), Plan([]))
    pm.init_weights(seed=0)
    batch = dtmega.synthetic_batch(BATCH, SEQ, CONFIG.vocab_size)
    times = {"plain": [], "parallelize(Plan([]))": []}
    for step in range(steps + 2):
        for name, run in (("plain", lambda: plain_step(plain, batch)),
                          ("parallelize(Plan([]))", lambda: pm.forward_backward(batch))):
            start = time.perf_counter()
            run()
            if step >= 2:  # warm-up
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"step_seconds": medians, "overhead": medians["parallelize(Plan([]))"] / medians["plain"] - 1}


def multi_rank_worker(steps: int, out: Path) -> None:
    """Runs under torchrun with 4 ranks: tokens/s of two plans on the same global batch."""
    results = {}
    plans = {
        "TP2 x FSDP2 (+SP)": (dict(tp=2), [TensorParallel(), SequenceParallel(), DataParallel("fsdp")]),
        "FSDP4": (dict(tp=1), [DataParallel("fsdp")]),
    }
    for name, (sizes, passes) in plans.items():
        with torch.device("meta"):
            model = Llama(CONFIG)
        pm = dtmega.parallelize(model, dtmega.make_mesh(device_type="cpu", **sizes), Plan(passes))
        pm.init_weights(seed=0)
        batch = pm.shard_batch(dtmega.synthetic_batch(BATCH, SEQ, CONFIG.vocab_size))
        optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        durations = []
        for step in range(steps + 2):
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad()
            pm.forward_backward(batch)
            optimizer.step()
            dist.barrier()
            if step >= 2:
                durations.append(time.perf_counter() - start)
        median = statistics.median(durations)
        results[name] = {"step_seconds": median, "tokens_per_second": BATCH * SEQ / median}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "overhead.json")
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_out:
        multi_rank_worker(args.steps, args.worker_out)
        return {}
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    single = one_rank_overhead(args.steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    worker_out = args.out.with_suffix(".ranks.json")
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc-per-node", "4", __file__, "--steps", str(args.steps), "--worker-out", str(worker_out)]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    multi = json.loads(worker_out.read_text())
    worker_out.unlink()
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine(),
        "model": {"params": CONFIG.num_params(), "batch": BATCH, "seq_len": SEQ},
        "one_rank": single,
        "four_ranks": multi,
    }
    args.out.write_text(json.dumps(result, indent=2))
    table = Table(title=f"dtmega overhead ({CONFIG.num_params():,} params, batch {BATCH}x{SEQ})")
    for column in ("run", "step (s)", "tokens/s", "note"):
        table.add_column(column)
    for name, seconds in single["step_seconds"].items():
        table.add_row(f"1 rank, {name}", f"{seconds:.4f}", f"{BATCH * SEQ / seconds:,.0f}", "")
    table.add_row("", "", "", f"framework overhead {single['overhead'] * 100:+.1f}%")
    for name, row in multi.items():
        table.add_row(f"4 ranks, {name}", f"{row['step_seconds']:.4f}", f"{row['tokens_per_second']:,.0f}", "incl. AdamW")
    console().print(table)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
