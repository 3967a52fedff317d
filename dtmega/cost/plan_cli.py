"""`dtmega plan`: rank every legal parallel plan for a model, a GPU count and a workload.

    dtmega plan --model llama3-70b --gpus 64 --gpus-per-node 8 --gpu h100 \\
        --seq-length 4096 --global-batch-size 1024 [--fp8 [--fp8-recipe R]] [--json] [--out plan.toml]

Prints the best plans with memory per GPU, step time and MFU, the rejected ones by reason, and
the chosen plan as `dtmega train` flags; `--out` writes it as a `dtmega train --config` TOML;
`--compare tp=4,pp=4` says where a plan of your own ranks, whether it fits and why the best one
is faster. `--framework megatron-core|torchtitan` costs every plan as that framework runs it
(how the model is held against their published runs; no train flags then). `--json` prints the
ranked list (best first) as JSON instead. docs/planning.md has the formulas and the validation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.table import Table

from dtmega.cost.estimate import CostEstimate, estimate
from dtmega.cost.frameworks import FRAMEWORKS
from dtmega.cost.hardware import BUILT_IN, Hardware, load_hardware
from dtmega.cost.memory import gib
from dtmega.cost.plan_flags import as_flags, train_options
from dtmega.cost.search import RunWorkload, SearchResult, matches, parse_plan_spec, plan_from_spec, search
from dtmega.cost.shapes import ModelShape
from dtmega.kernels.errors import DtmegaError
from dtmega.passes.toml_io import dump_toml

FP8_RECIPES = ("delayed", "tensorwise", "rowwise")  # the scalings the cost model tells apart


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
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="sequences per optimizer step (default: one per GPU, --gpus)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="compute dtype (weights, gradients and Adam stay fp32)")
    parser.add_argument("--fp8", action="store_true", help="the blocks' linears in FP8 (GEMMs at the FP8 rate, "
                        "casts and FP8 weight all-gathers counted)")
    parser.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=None,
                        help="FP8 scaling (implies --fp8; default delayed, dtmega train's default)")
    parser.add_argument("--framework", default="dtmega", choices=tuple(FRAMEWORKS),
                        help="whose implementation runs the plans (dtmega/cost/frameworks.py); default dtmega")
    parser.add_argument("--document-length", type=int, default=None,
                        help="packed documents masked per document (--reset-attention-mask): their mean length in "
                             "tokens; attention costs each document's own work, and dtmega's CP plans use all-to-all")
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
    if args.global_batch_size is None:
        args.global_batch_size = args.gpus  # one sequence per GPU and step (Megatron's micro-batch 1, no accumulation)
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
    if args.out and args.framework != "dtmega":
        raise PlanArgumentError(f"--out writes a dtmega train config, but --framework {args.framework} costs plans as "
                                f"{args.framework} runs them. Fix: drop --out, or --framework dtmega")
    model = model_shape_for(args.model)
    hardware = load_hardware(args.gpu)
    fp8 = args.fp8_recipe or ("delayed" if args.fp8 else None)
    if fp8 and "float8" not in hardware.peak_flops:
        raise PlanArgumentError(f"--fp8: {hardware.name} lists no FP8 rate (H100, H200 and B200 do). Fix: --gpu one of "
                                "those, or a hardware file with a float8 peak")
    if fp8 and args.dtype == "float32":
        raise PlanArgumentError("--fp8 with --dtype float32: FP8 training keeps bf16 or fp16 activations. Fix: "
                                "--dtype bfloat16")
    if args.document_length is not None and args.document_length < 1:
        raise PlanArgumentError(f"--document-length must be a positive number of tokens, got {args.document_length}")
    work = RunWorkload(args.seq_length, args.global_batch_size, args.dtype, fp8, args.document_length)
    specs = [parse_plan_spec(text) for text in args.compare]
    result = search(model, args.gpus, min(args.gpus_per_node, args.gpus), work, hardware, headroom=args.headroom,
                    max_micro_batch=args.max_micro_batch, allow_cpu_optimizer=not args.no_cpu_optimizer,
                    framework=args.framework)
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
    """Why `best` is faster than `other`, by time component, with numbers ('compute 9.4 s vs the
    best's 8.5 s': `other`'s seconds per step first)."""
    names = ("compute", "memory", "launches", "exposed_comm", "bubble", "optimizer")
    gaps = {name: getattr(other.time, name) - getattr(best.time, name) for name in names}
    parts = [f"{name} {getattr(other.time, name):.3f} s vs the best's {getattr(best.time, name):.3f} s"
             for name in names if abs(gaps[name]) > 0.005 * best.step_s]
    if parts:
        return ", ".join(parts)
    # a near-tie: no component moves by 0.5 % of the step; name the one that moves most
    name = max(names, key=lambda n: abs(gaps[n]))
    return (f"step {other.step_s:.4f} s vs the best's {best.step_s:.4f} s, most of it {name} "
            f"{getattr(other.time, name):.4f} s vs the best's {getattr(best.time, name):.4f} s")


def compare_lines(model: ModelShape, work: RunWorkload, result: SearchResult, hardware: Hardware,
                  specs: list[dict], *, gpus: int, framework: str = "dtmega", headroom: float = 0.9) -> list[str]:
    """For each --compare spec: whether it fits, its predicted speed and rank among every legal
    plan that fits, and why the best is faster. A spec that names only some sizes (tp=4,pp=4) is
    the best candidate with them; one the search did not enumerate (a micro-batch above
    --max-micro-batch, a data-parallel mode) is costed on its own."""
    lines = []
    best = result.ranked[0] if result.ranked else None
    capacity = headroom * hardware.memory_bytes
    for spec in specs:
        name = ",".join(f"{k}={v}" for k, v in spec.items())
        ranks = [i for i, c in enumerate(result.ranked, 1) if matches(c.plan, spec)]
        if ranks:
            mine = result.ranked[ranks[0] - 1]
        else:
            try:
                plan = plan_from_spec(spec, model, gpus, work, framework=framework,
                                      fused_optimizer=hardware.fused_optimizer)
            except DtmegaError as error:
                lines.append(f"compare {name}: not a plan for these GPUs and workload: {error}")
                continue
            mine = estimate(model, plan, work.seq, hardware)
            if mine.memory.peak > capacity:
                lines.append(f"compare {name}: {mine.plan.describe()} does NOT fit: {gib(mine.memory.peak):.1f} GiB of "
                             f"the {gib(capacity):.1f} GiB a plan may use ({headroom:.0%} of {hardware.name}'s); it "
                             f"would run at {mine.tokens_per_s_per_gpu:,.0f} tokens/s/GPU")
                continue
        rank = 1 + sum(1 for c in result.ranked if c.tokens_per_s_per_gpu > mine.tokens_per_s_per_gpu * 1.0005)
        head = (f"compare {name}: {mine.plan.describe()} fits ({gib(mine.memory.peak):.1f} of {gib(capacity):.1f} GiB), "
                f"{mine.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {mine.mfu:.1%}, rank #{rank} of {len(result.ranked):,}")
        if best is None or mine.tokens_per_s_per_gpu >= best.tokens_per_s_per_gpu / 1.0005:
            lines.append(f"{head}: as fast as the best plan ({best.plan.describe() if best else 'none'})")
            continue
        slower = best.tokens_per_s_per_gpu / mine.tokens_per_s_per_gpu - 1
        lines.append(f"{head}; the best, {best.plan.describe()}, is {slower:.1%} faster; where the time goes: "
                     f"{explain(best, mine)}")
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
    options = train_options(best.plan, model, work) if args.framework == "dtmega" else {}
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
    for line in compare_lines(model, work, result, hardware, specs, gpus=args.gpus, framework=args.framework,
                              headroom=args.headroom):
        out.print(line, highlight=False, soft_wrap=True)
    out.print(best.table())
    if args.framework == "dtmega":
        out.print(f"dtmega train --model {args.model} {as_flags(options)}", highlight=False, soft_wrap=True)
    else:
        out.print(f"(costed as {args.framework} runs each plan: {FRAMEWORKS[args.framework].summary}; not a dtmega "
                  "train command)", highlight=False, soft_wrap=True)
    if args.out:
        out.print(f"wrote {args.out} (dtmega train --config {args.out})", highlight=False)


def best_plan(model: ModelShape, gpus: int, gpus_per_node: int, work: RunWorkload, hardware) -> CostEstimate:
    """The top plan, for `dtmega train --auto-plan` (PlanArgumentError naming why if none fits)."""
    result = search(model, gpus, min(gpus_per_node, gpus), work, hardware)
    if not result.ranked:
        reasons = "; ".join(f"{n} x {r} (e.g. {result.examples[r]})" for r, n in result.rejected.most_common())
        raise PlanArgumentError(f"--auto-plan: no plan fits {gpus} x {hardware.name}: {reasons}")
    return result.ranked[0]


