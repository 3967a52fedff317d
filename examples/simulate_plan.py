"""Check a plan for thousands of ranks on a laptop: a fake process group, a meta-device model,
the real passes. Prints the layout report and the per-rank parameter count.

    python examples/simulate_plan.py --model llama3-405b --world 512 --tp 8
    python examples/simulate_plan.py --model llama3-405b --world 128 --tp 8 --pp 8   # + per-stage counts
    python examples/simulate_plan.py --model llama3-70b --world 1024 --tp 8 --dp-replicate 4 --json
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

import dtmega
from dtmega.models import Llama, LlamaConfig
from dtmega.passes import DataParallel, PipelineSplit, Plan, Recompute, SequenceParallel, TensorParallel


def stage_parameters(layout) -> dict[int, dict[str, int]]:
    """Per pipeline stage: parameters of the unsharded stage and on its first rank."""
    stages: dict[int, dict[str, int]] = {}
    for entry in layout.modules.values():
        for param in entry.params.values():
            row = stages.setdefault(entry.stage, {"global": 0, "per_rank": 0})
            row["global"] += math.prod(param.shape)
            row["per_rank"] += math.prod(param.local_shape(layout.mesh))
    stages.pop(None, None)
    return dict(sorted(stages.items()))


def simulate(model: str, world: int, tp: int, dp_replicate: int, sequence_parallel: bool, pp: int = 1) -> dict:
    """Parallelizes `model` on the meta device in a fake world; returns what it measured."""
    start = time.perf_counter()
    with dtmega.simulate_world(world):
        mesh = dtmega.make_mesh(pp=pp, tp=tp, dp_replicate=dp_replicate, device_type="cpu")
        with torch.device("meta"):
            llama = Llama(LlamaConfig.from_name(model))
        passes = [TensorParallel()] + ([SequenceParallel()] if sequence_parallel else [])
        if pp > 1:  # embedding and loss count as one block each (Llama 3 405B's own 16-per-stage split)
            passes.append(PipelineSplit(microbatches=2 * pp, count_embedding=True, count_loss=True))
        passes += [Recompute("full"), DataParallel("hsdp" if dp_replicate > 1 else "fsdp", param_dtype="bfloat16")]
        pm = dtmega.parallelize(llama, mesh, Plan(passes))
        elapsed = time.perf_counter() - start
        local = [p.to_local() for p in pm.parameters()]
        return {
            "model": model,
            "mesh": pm.layout.mesh,
            "seconds": elapsed,
            "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "all_meta": all(t.is_meta for t in local),
            "local_params": sum(t.numel() for t in local),
            "layout_local_params": pm.layout.local_param_count(),
            "global_params": pm.layout.global_param_count(),
            "stages": stage_parameters(pm.layout) if pp > 1 else {},
            "report": pm.report(),
        }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-405b")
    parser.add_argument("--world", type=int, default=512)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--no-sequence-parallel", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    args = parser.parse_args(argv)
    result = simulate(args.model, args.world, args.tp, args.dp_replicate, not args.no_sequence_parallel, args.pp)
    report = result.pop("report")
    if args.json:
        print(json.dumps(result))
    else:
        console = Console(width=200)
        console.print(report)
        if result["stages"]:
            table = Table(title="parameters per pipeline stage")
            for column in ("stage", "unsharded", "per rank"):
                table.add_column(column, justify="right")
            for stage, row in result["stages"].items():
                table.add_row(str(stage), f"{row['global']:,}", f"{row['per_rank']:,}")
            console.print(table)
        console.print(
            f"{args.model} on {args.world} simulated ranks: parallelize took {result['seconds']:.1f} s, "
            f"peak RSS {result['max_rss_gib']:.2f} GiB, {result['local_params']:,} parameters per rank"
        )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
