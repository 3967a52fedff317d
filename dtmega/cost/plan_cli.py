"""`dtmega plan`: rank every legal parallel plan for a model, a GPU count and a workload.

    dtmega plan --model llama3-70b --gpus 64 --gpus-per-node 8 --gpu h100 \\
        --seq-length 4096 --global-batch-size 1024 [--json] [--out plan.toml]

Prints the best plans with memory per GPU, step time and MFU, the rejected ones by reason, and
the chosen plan as `dtmega train` flags; `--out` writes it as a `dtmega train --config` TOML;
`--compare tp=4,pp=4` says where a plan of your own ranks and why the best one is faster.
`--json` prints the ranked list (best first) as JSON instead. docs/planning.md has the formulas.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from rich.table import Table

from dtmega.cost.estimate import CostEstimate
from dtmega.cost.hardware import BUILT_IN, load_hardware
from dtmega.cost.memory import gib
from dtmega.cost.plan_flags import as_flags, train_options
from dtmega.cost.search import RunWorkload, SearchResult, matches, parse_plan_spec, search
from dtmega.cost.shapes import ModelShape
from dtmega.kernels.errors import DtmegaError
from dtmega.passes.toml_io import dump_toml


class PlanArgumentError(DtmegaError):
    """Options `dtmega plan` cannot use; the message names the fix."""


def build_parser() -> argparse.ArgumentParser:
    """The options of `dtmega plan`."""
    parser = argparse.ArgumentParser(prog="dtmega plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="a registered model (llama3-8b, llama3-70b, ...; yours with --custom-import)")
    parser.add_argument("--custom-import", nargs="+", default=[],
                        help="Python modules to import first (they register models and their families)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (TP and HSDP stay inside one)")
    parser.add_argument("--gpu", default="h100", help=f"{', '.join(BUILT_IN)}, or a file from `dtmega calibrate`")
    parser.add_argument("--seq-length", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--global-batch-size", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="compute dtype (weights, gradients and Adam stay fp32)")
    parser.add_argument("--fp8", action="store_true", help="the blocks' matmuls at the FP8 tensor-core rate")
    parser.add_argument("--max-micro-batch", type=int, default=16, help="largest micro-batch to consider")
    parser.add_argument("--headroom", type=float, default=0.9,
                        help="fraction of device memory a plan may use (the rest: fragmentation, CUDA context)")
    parser.add_argument("--no-cpu-optimizer", action="store_true", help="never offload the optimizer to the host")
    parser.add_argument("--top", type=int, default=None,
                        help="plans to print (default: 10 in the table, every fitting plan with --json)")
    parser.add_argument("--compare", action="append", default=[], metavar="SPEC",
                        help="a plan of your own, e.g. tp=4,pp=4,cp=1: where it ranks and why the best is faster")
    parser.add_argument("--json", action="store_true", help="print the ranked list as JSON (best first)")
    parser.add_argument("--out", type=Path, help="write the best plan as a `dtmega train --config` TOML")
    return parser


def import_custom(modules: list[str]) -> None:
    """Imports --custom-import modules (they register models and families); PlanArgumentError
    naming a module that does not import."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise PlanArgumentError(f"--custom-import {module}: {error}. Fix: a module importable from here "
                                    "(on PYTHONPATH)") from None


def model_shape_for(name: str) -> ModelShape:
    """The registered model's sizes, from its family's facts (dtmega.cost.analysis)."""
    from dtmega.cost.analysis import model_shape_of_spec
    from dtmega.models.registry import model_names, model_spec

    try:
        spec = model_spec(name)
    except KeyError:
        raise PlanArgumentError(f"--model {name!r} is unknown; choose one of {', '.join(model_names())}") from None
    return model_shape_of_spec(spec)


def run_search(args: argparse.Namespace) -> tuple[ModelShape, RunWorkload, SearchResult, object]:
    """Checks the options and searches."""
    import_custom(args.custom_import)
    for flag, value in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node),
                        ("--seq-length", args.seq_length), ("--global-batch-size", args.global_batch_size),
                        ("--max-micro-batch", args.max_micro_batch)):
        if value < 1:
            raise PlanArgumentError(f"{flag} must be a positive integer, got {value}")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        raise PlanArgumentError(f"--gpus {args.gpus} is not a whole number of nodes of --gpus-per-node "
                                f"{args.gpus_per_node}")
    if not 0 < args.headroom <= 1:
        raise PlanArgumentError(f"--headroom {args.headroom} must be in (0, 1]")
    model = model_shape_for(args.model)
    hardware = load_hardware(args.gpu)
    if args.fp8:
        if "float8" not in hardware.peak_flops:
            raise PlanArgumentError(f"--fp8: {hardware.name} lists no FP8 rate (H100, H200 and B200 do)")
        hardware = dataclasses.replace(hardware, peak_flops={**hardware.peak_flops,
                                                             "bfloat16": hardware.peak_flops["float8"]})
    work = RunWorkload(args.seq_length, args.global_batch_size, args.dtype)
    specs = [parse_plan_spec(text) for text in args.compare]
    result = search(model, args.gpus, min(args.gpus_per_node, args.gpus), work, hardware, headroom=args.headroom,
                    max_micro_batch=args.max_micro_batch, allow_cpu_optimizer=not args.no_cpu_optimizer)
    return model, work, result, (hardware, specs)


def ranked_table(result: SearchResult, top: int, title: str) -> Table:
    """The best `top` plans."""
    table = Table(title=title)
    for column in ("#", "plan", "tp", "pp", "vp", "cp", "dp", "ep", "mb", "recompute", "GiB/GPU", "step s",
                   "tokens/s/GPU", "MFU"):
        table.add_column(column, justify="left" if column in ("plan", "recompute") else "right")
    for index, c in enumerate(result.ranked[:top], 1):
        p = c.plan
        table.add_row(str(index), p.describe(), str(p.tp), str(p.pp), str(p.vp), str(p.cp), str(p.dp), str(p.ep),
                      str(p.micro_batch), p.recompute, f"{gib(c.memory.peak):.1f}", f"{c.step_s:.3f}",
                      f"{c.tokens_per_s_per_gpu:,.0f}", f"{c.mfu:.1%}")
    return table


def explain(best: CostEstimate, other: CostEstimate) -> str:
    """Why `best` is faster than `other`, by time component, with numbers."""
    parts = []
    for name in ("compute", "memory", "launches", "exposed_comm", "bubble", "optimizer"):
        a, b = getattr(best.time, name), getattr(other.time, name)
        if abs(b - a) > 0.005 * best.step_s:
            parts.append(f"{name} {b:.3f} s vs {a:.3f} s")
    return ", ".join(parts) or "the same components within 0.5 %"


def compare_lines(model: ModelShape, work: RunWorkload, result: SearchResult, hardware, specs: list[dict]) -> list[str]:
    """For each --compare spec: its rank (or why it is not a candidate) and the difference."""
    lines = []
    best = result.ranked[0] if result.ranked else None
    for spec in specs:
        ranks = [i for i, c in enumerate(result.ranked, 1) if matches(c.plan, spec)]
        name = ",".join(f"{k}={v}" for k, v in spec.items())
        if not ranks:
            lines.append(f"compare {name}: no legal plan that fits has these sizes (see the rejected counts)")
            continue
        rank = ranks[0]
        mine = result.ranked[rank - 1]
        if rank == 1:
            lines.append(f"compare {name}: the best plan is one of these ({mine.plan.describe()})")
            continue
        slower = best.tokens_per_s_per_gpu / mine.tokens_per_s_per_gpu - 1
        lines.append(f"compare {name}: best of its kind is #{rank} {mine.plan.describe()}: "
                     f"{mine.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {slower:.1%} slower than #1, "
                     f"{gib(mine.memory.peak):.1f} GiB; where the time goes: {explain(best, mine)}")
    return lines


def main(argv: list[str] | None = None) -> None:
    """`dtmega plan`."""
    from dtmega.printing import console

    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    model, work, result, (hardware, specs) = run_search(args)
    seconds = time.perf_counter() - start
    if not result.ranked:
        reasons = "; ".join(f"{n} x {reason} (e.g. {result.examples[reason]})" for reason, n in result.rejected.most_common())
        raise PlanArgumentError(f"no plan for {args.model} on {args.gpus} {hardware.name} fits: {reasons}. Fix: more "
                                "GPUs, a shorter sequence, a smaller global batch, or --gpu with more memory")
    best = result.ranked[0]
    options = train_options(best.plan, model, work)
    if args.out:
        dump_toml({"model": args.model, **options}, args.out)
    if args.json:
        json.dump([c.to_dict() for c in result.ranked[:args.top]], sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    out = console()
    out.print(ranked_table(result, args.top or 10, f"{args.model} on {args.gpus} x {hardware.name} "
                           f"({args.gpus_per_node} per node), seq {work.seq}, global batch {work.global_batch}"))
    out.print(f"{result.considered:,} legal plans estimated in {seconds:.1f} s, {len(result.ranked):,} fit; rejected: "
              + "; ".join(f"{n:,} {reason} (e.g. {result.examples[reason]})"
                          for reason, n in result.rejected.most_common()), highlight=False)
    for line in compare_lines(model, work, result, hardware, specs):
        out.print(line, highlight=False)
    out.print(best.table())
    out.print(f"dtmega train --model {args.model} {as_flags(options)}", highlight=False, soft_wrap=True)
    if args.out:
        out.print(f"wrote {args.out} (dtmega train --config {args.out})", highlight=False)


def best_plan(model: ModelShape, gpus: int, gpus_per_node: int, work: RunWorkload, hardware) -> CostEstimate:
    """The top plan, for `dtmega train --auto-plan` (PlanArgumentError naming why if none fits)."""
    result = search(model, gpus, min(gpus_per_node, gpus), work, hardware)
    if not result.ranked:
        reasons = "; ".join(f"{n} x {r} (e.g. {result.examples[r]})" for r, n in result.rejected.most_common())
        raise PlanArgumentError(f"--auto-plan: no plan fits {gpus} x {hardware.name}: {reasons}")
    return result.ranked[0]


