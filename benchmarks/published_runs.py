"""The planner against the world's published runs: every row of benchmarks/published_runs.toml
(Megatron-Core on DGX H100 clusters of 8 to 1,024 GPUs, torchtitan on up to 512) costed by
`dtmega plan`'s model as its own framework runs it, beside what was measured.

    python benchmarks/published_runs.py [--search [--write-docs]] [--only ID ...] [--fit]
        [--out benchmarks/results/published_runs.json]

For each row: whether the published configuration fits its GPU's memory by the model (with the
planner's headroom), predicted against published tokens/s/GPU, and with --search the planner's
best plan for the same model, GPUs and workload, the published configuration's rank among the
legal plans and, where the best differs, why (time components, seconds per step). Ends with the
share of rows within 15 % and 25 % and the geometric-mean error. No GPU is needed: this is the
model, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine  # noqa: E402
from dtmega.cost.estimate import CostEstimate, estimate  # noqa: E402
from dtmega.cost.hardware import Hardware, load_hardware  # noqa: E402
from dtmega.cost.memory import gib  # noqa: E402
from dtmega.cost.plan_cli import explain, model_shape_for  # noqa: E402
from dtmega.cost.search import RunWorkload, SearchResult, plan_from_spec, search  # noqa: E402
from dtmega.cost.shapes import ModelShape  # noqa: E402
from dtmega.passes.toml_io import load_toml  # noqa: E402
from dtmega.printing import console  # noqa: E402

RUNS = ROOT / "benchmarks" / "published_runs.toml"
HEADROOM = 0.9  # `dtmega plan`'s default: the rest for fragmentation and the CUDA context


@dataclass(frozen=True)
class PublishedRun:
    """One row of the validation set (benchmarks/published_runs.toml says what each field is)."""

    row: dict

    @property
    def id(self) -> str:
        return self.row["id"]

    @property
    def measured(self) -> float:
        return float(self.row["measured_tokens_per_s_per_gpu"])

    def workload(self) -> RunWorkload:
        fp8 = self.row.get("fp8_recipe") if self.row["precision"] == "fp8" else None
        return RunWorkload(self.row["seq"], self.row["global_batch"], "bfloat16", fp8)

    def spec(self) -> dict[str, object]:
        """The published configuration as a `dtmega plan --compare` spec."""
        r = self.row
        spec: dict[str, object] = {"tp": r["tp"], "pp": r["pp"], "vp": r["vp"], "cp": r["cp"], "mb": r["micro_batch"],
                                   "recompute": r["recompute"], "mode": r["data_parallel"], "overlap": r["tp_overlap"]}
        if r.get("recompute_layers"):
            spec["recompute_layers"] = r["recompute_layers"]
        if r.get("account_for_embedding_and_loss"):
            spec["split"] = "embedding-and-loss"
        return spec

    def compare_text(self) -> str:
        """The spec as `dtmega plan --compare` takes it."""
        return ",".join(f"{key}={value}" for key, value in self.spec().items())

    def plan_command(self) -> str:
        """The `dtmega plan` line that ranks this row's configuration among every legal plan."""
        r = self.row
        return (f"dtmega plan --model {r['model']} --gpus {r['gpus']} --gpu {r['gpu']} --framework {r['framework']} "
                f"--seq-length {r['seq']} --global-batch-size {r['global_batch']}"
                + (f" --fp8 --fp8-recipe {r['fp8_recipe']}" if r["precision"] == "fp8" else "")
                + f" --compare {self.compare_text()}")


def load_runs(path: Path = RUNS) -> list[PublishedRun]:
    """The validation set's rows."""
    return [PublishedRun(row) for row in load_toml(path)["run"]]


@dataclass
class Judged:
    """One row costed: the published plan's estimate, whether it fits, and the search's view."""

    run: PublishedRun
    estimate: CostEstimate
    hardware: Hardware
    fits: bool
    best: CostEstimate | None = None
    rank: int | None = None
    legal: int | None = None

    @property
    def predicted(self) -> float:
        return self.estimate.tokens_per_s_per_gpu

    @property
    def ratio(self) -> float:
        return self.predicted / self.run.measured


_SHAPES: dict[str, ModelShape] = {}
_SEARCHES: dict[tuple, SearchResult] = {}  # rows that share a model, GPUs and workload share one search


def judge(run: PublishedRun, with_search: bool = False) -> Judged:
    """Costs one row (and with `with_search`, ranks it among every legal plan)."""
    r = run.row
    if r["model"] not in _SHAPES:  # a meta-device build per model, once
        _SHAPES[r["model"]] = model_shape_for(r["model"])
    model = _SHAPES[r["model"]]
    hardware = load_hardware(r["gpu"])
    work = run.workload()
    plan = plan_from_spec(run.spec(), model, r["gpus"], work, framework=r["framework"],
                          fused_optimizer=hardware.fused_optimizer)
    if "compile" in r:  # torchtitan's torch.compile: fused elementwise kernels, or eager ones
        plan = dataclasses.replace(plan, compiled=r["compile"], fused_kernels=r["compile"])
    cost = estimate(model, plan, work.seq, hardware)
    judged = Judged(run, cost, hardware, cost.memory.peak <= HEADROOM * hardware.memory_bytes)
    if with_search:
        # as `dtmega plan` searches by default (plan_command's line ranks it the same way)
        key = (r["model"], r["gpus"], r["gpu"], work, r["framework"], max(16, r["micro_batch"]))
        if key not in _SEARCHES:
            _SEARCHES[key] = search(model, r["gpus"], min(8, r["gpus"]), work, hardware, headroom=HEADROOM,
                                    max_micro_batch=key[-1], framework=r["framework"])
        result = _SEARCHES[key]
        judged.legal = len(result.ranked)
        judged.best = result.ranked[0] if result.ranked else None
        judged.rank = 1 + sum(1 for c in result.ranked if c.tokens_per_s_per_gpu > cost.tokens_per_s_per_gpu * 1.0005)
    return judged


# What `--fit` fits, per framework: Framework fields (tp_exposed.* a key of its dict), with bounds.
FITTED = {
    "megatron-core": {"fp8_gemm": (0.2, 1.0), "attention": (0.2, 1.0), "elementwise": (0.5, 20.0),
                      "ring_attention": (0.2, 1.0)},
    "torchtitan": {"gemm": (0.2, 1.0), "fp8_gemm": (0.2, 1.0), "rowwise_fp8_gemm": (0.2, 1.0),
                   "attention": (0.2, 1.0), "ring_attention": (0.2, 1.0), "elementwise": (0.5, 20.0),
                   "eager_elementwise": (0.5, 40.0), "tp_exposed.async": (0.0, 1.0), "step_overhead": (0.0, 1.0)},
}


def _with(framework, name: str, value: float):
    if name.startswith("tp_exposed."):
        return dataclasses.replace(framework, tp_exposed={**framework.tp_exposed, name.split(".", 1)[1]: value})
    return dataclasses.replace(framework, **{name: value})


def _value(framework, name: str) -> float:
    return framework.tp_exposed[name.split(".", 1)[1]] if name.startswith("tp_exposed.") else getattr(framework, name)


def fit(runs: list[PublishedRun], framework_name: str, rounds: int = 8) -> dict[str, float]:
    """The framework efficiencies that minimise the mean squared log error of the calibration
    rows (coordinate descent in log space, within FITTED's bounds); registers them and returns them."""
    from dtmega.cost.frameworks import FRAMEWORKS, register_framework

    rows = [run for run in runs if run.row["framework"] == framework_name and run.row.get("calibration")]

    def loss() -> float:
        return sum(math.log(judge(run).ratio) ** 2 for run in rows) / len(rows)

    best = loss()
    for _ in range(rounds):
        for name, (low, high) in FITTED[framework_name].items():
            for step in (0.3, 0.1, 0.03, 0.01):
                for sign in (1, -1):
                    while True:
                        current = FRAMEWORKS[framework_name]
                        value = _value(current, name)
                        new = value * math.exp(sign * step) if value > 0 else (0.01 if sign > 0 else 0.0)
                        new = min(high, max(low, new))
                        if new == value:
                            break
                        register_framework(_with(current, name, new))
                        trial = loss()
                        if trial < best - 1e-12:
                            best = trial
                        else:
                            register_framework(current)
                            break
    return {name: _value(FRAMEWORKS[framework_name], name) for name in FITTED[framework_name]}


def _shares(ratios: list[float]) -> dict:
    return {"rows": len(ratios), "within_15": sum(abs(x - 1) <= 0.15 for x in ratios),
            "within_25": sum(abs(x - 1) <= 0.25 for x in ratios),
            "geomean_error": math.exp(sum(abs(math.log(x)) for x in ratios) / len(ratios)) - 1 if ratios else 0.0}


def summary(judged: list[Judged]) -> dict:
    """Shares within 15 % and 25 %, and the geometric-mean error (exp(mean |log ratio|) - 1), of
    every row and of the rows the efficiencies were not fitted on."""
    held_out = [j.ratio for j in judged if not j.run.row.get("calibration")]
    return {**_shares([j.ratio for j in judged]), "held_out": _shares(held_out),
            "all_fit": all(j.fits for j in judged)}


def table(judged: list[Judged]) -> Table:
    """Predicted vs published, one row each."""
    out = Table(title="dtmega plan's cost model vs published training runs (tokens/s/GPU)")
    for column in ("run", "framework", "plan", "GiB (fits?)", "published", "predicted", "ratio",
                   "planner's best", "its tokens/s", "published plan's rank"):
        out.add_column(column, justify="left" if column in ("run", "framework", "plan", "planner's best") else "right")
    for j in judged:
        best = j.best
        name = j.run.id + (" (fit)" if j.run.row.get("calibration") else "")
        out.add_row(name, j.run.row["framework"], j.estimate.plan.describe(),
                    f"{gib(j.estimate.memory.peak):.1f} ({'yes' if j.fits else 'NO'})", f"{j.run.measured:,.0f}",
                    f"{j.predicted:,.0f}", f"{j.ratio:.2f}", best.plan.describe() if best else "-",
                    f"{best.tokens_per_s_per_gpu:,.0f}" if best else "-",
                    f"#{j.rank} of {j.legal}" if j.rank else "-")
    return out


DOCS = ROOT / "docs" / "planning.md"
BEGIN, END = "<!-- published-runs table: begin -->", "<!-- published-runs table: end -->"


def markdown(judged: list[Judged]) -> str:
    """The validation table as docs/planning.md holds it (between BEGIN and END; the suite checks
    the two agree: tests/unit/test_published_runs.py)."""
    totals = summary(judged)
    held = totals["held_out"]
    lines = ["| run (source) | GPUs | precision | published plan | GiB (fits?) | published | predicted | ratio | "
             "planner's best: plan, tokens/s/GPU | published plan's rank |", "|---" * 10 + "|"]
    for j in judged:
        r = j.run.row
        precision = "bf16" if r["precision"] == "bf16" else f"fp8 {r['fp8_recipe']}"
        best = j.best
        lines.append(
            f"| [{j.run.id}]({r['source']}){' (fit)' if r.get('calibration') else ''} | {r['gpus']} | {precision} | "
            f"{j.estimate.plan.describe()} | {gib(j.estimate.memory.peak):.1f} ({'yes' if j.fits else 'NO'}) | "
            f"{j.run.measured:,.0f} | {j.predicted:,.0f} | {j.ratio:.2f} | "
            + (f"{best.plan.describe()}, {best.tokens_per_s_per_gpu:,.0f} | #{j.rank} of {j.legal:,} |" if best else
               "- | - |"))
    lines.append("")
    lines.append(f"{totals['within_15']} of {totals['rows']} rows within 15 %, {totals['within_25']} within 25 %, "
                 f"geometric-mean error {totals['geomean_error']:.1%}; the {held['rows']} rows not fitted on: "
                 f"{held['within_15']} within 15 %, {held['within_25']} within 25 %, {held['geomean_error']:.1%}. "
                 f"Every published configuration fits: {'yes' if totals['all_fit'] else 'NO'}.")
    return "\n".join(lines)


def docs_table(path: Path = DOCS) -> str:
    """What docs/planning.md holds between the markers."""
    text = path.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip("\n")


def write_docs(judged: list[Judged], path: Path = DOCS) -> None:
    """Replaces the table between the markers in docs/planning.md."""
    text = path.read_text()
    head, tail = text[:text.index(BEGIN) + len(BEGIN)], text[text.index(END):]
    path.write_text(f"{head}\n{markdown(judged)}\n{tail}")


def record(j: Judged) -> dict:
    """A row for the JSON file."""
    out = {"id": j.run.id, "framework": j.run.row["framework"], "gpu": j.run.row["gpu"], "plan": j.estimate.plan.describe(),
           "published_tokens_per_s_per_gpu": j.run.measured, "predicted_tokens_per_s_per_gpu": j.predicted,
           "ratio": j.ratio, "memory_gib": gib(j.estimate.memory.peak), "fits": j.fits,
           "step_s": j.estimate.step_s, "time": j.estimate.time.__dict__, "source": j.run.row["source"],
           "command": j.run.plan_command()}
    if j.best is not None:
        out.update(best_plan=j.best.plan.describe(), best_tokens_per_s_per_gpu=j.best.tokens_per_s_per_gpu,
                   rank=j.rank, legal_plans=j.legal,
                   why_best=explain(j.best, j.estimate) if j.rank and j.rank > 1 else "")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=RUNS, help="the validation set (TOML)")
    parser.add_argument("--search", action="store_true", help="also rank every legal plan for each row (slower)")
    parser.add_argument("--only", nargs="*", default=[], help="rows whose id contains one of these")
    parser.add_argument("--fit", action="store_true",
                        help="fit the frameworks' efficiencies on the rows marked calibration, print them, and cost "
                             "every row with them (what dtmega/cost/frameworks.py holds was fitted this way)")
    parser.add_argument("--write-docs", action="store_true",
                        help="with --search: write the table into docs/planning.md (the suite checks it matches)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "published_runs.json")
    args = parser.parse_args(argv)
    if args.write_docs and (not args.search or args.only or args.fit or args.runs != RUNS):
        parser.error("--write-docs needs --search on the recorded set as it is (no --only, --fit or --runs)")
    start = time.perf_counter()
    runs = [run for run in load_runs(args.runs) if not args.only or any(word in run.id for word in args.only)]
    if args.fit:
        for name in FITTED:
            fitted = fit(runs, name)
            console().print(f"{name}: " + ", ".join(f"{key} = {value:.3g}" for key, value in fitted.items()),
                            highlight=False)
    judged = [judge(run, with_search=args.search) for run in runs]
    totals = summary(judged)
    out = console()
    out.print(table(judged))
    held = totals["held_out"]
    out.print(f"{totals['within_15']} of {totals['rows']} rows within 15 %, {totals['within_25']} within 25 %; "
              f"geometric-mean error {totals['geomean_error']:.1%} (the {held['rows']} rows not fitted on: "
              f"{held['within_15']} within 15 %, {held['within_25']} within 25 %, {held['geomean_error']:.1%}); "
              f"every published configuration fits: {'yes' if totals['all_fit'] else 'NO'} "
              f"({time.perf_counter() - start:.1f} s)", highlight=False)
    for j in judged:
        if j.best is not None and j.rank and j.rank > 1:
            out.print(f"{j.run.id}: the planner's best, {j.best.plan.describe()}, is "
                      f"{j.best.tokens_per_s_per_gpu / j.predicted - 1:.1%} faster by the model: {explain(j.best, j.estimate)}",
                      highlight=False, soft_wrap=True)
    if args.write_docs:
        write_docs(judged)
        out.print(f"wrote the table into {DOCS}", highlight=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(["benchmarks/published_runs.py", *(argv or sys.argv[1:])]),
                                    "machine": machine(), "summary": totals,
                                    "rows": [record(j) for j in judged]}, indent=1))
    out.print(f"wrote {args.out}", highlight=False)


if __name__ == "__main__":
    main()
