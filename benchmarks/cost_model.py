"""The cost model against measurement: predicted vs measured peak memory and step time per rank
for plans covering DDP, FSDP, HSDP, TP+SP, PP (1F1B and interleaved), CP, EP and recompute.

    python benchmarks/cost_model.py [--hardware runs/cpu4.toml]      # table + benchmarks/results/cost_model.json

One torchrun job of 4 CPU ranks (gloo) trains a small Llama (and a mixture-of-experts variant for
EP) under each plan in fp32. Memory: torch's MemTracker (every tensor's storage, by device)
over one full step (forward, backward, optimizer) after a warm-up step, the peak of the busiest
rank. Time: the median of timed steps (all ranks start together). The predictions come from
`dtmega.check_plan(..., workload=..., hardware=...)` on the meta device, with the hardware file
`dtmega calibrate --ranks 4` wrote for this machine (measured first if not given).
"""

from __future__ import annotations

import argparse
import json
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

from benchmarks.common import machine, run_on_ranks, run_worker  # noqa: E402
from dtmega.printing import console  # noqa: E402

SEQ, MICRO_BATCH, STEPS = 512, 2, 5


def plans():
    """name -> (mesh sizes, passes, micro-batches, moe)."""
    from dtmega.passes import (
        ContextParallel,
        DataParallel,
        ExpertParallel,
        PipelineSplit,
        Recompute,
        SequenceParallel,
        TensorParallel,
    )

    return {
        "ddp4": (dict(dp_replicate=4), [DataParallel("ddp")], 1, False),
        "fsdp4": (dict(dp_shard=4), [DataParallel("fsdp")], 1, False),
        "hsdp2x2": (dict(dp_replicate=2, dp_shard=2), [DataParallel("hsdp")], 1, False),
        "tp2+sp fsdp2": (dict(dp_shard=2, tp=2), [TensorParallel(), SequenceParallel(), DataParallel("fsdp")], 1, False),
        "pp2 1f1b fsdp2": (dict(pp=2, dp_shard=2), [PipelineSplit(schedule="1f1b", microbatches=4),
                                                   DataParallel("fsdp")], 4, False),
        "pp2x2 interleaved ddp2": (dict(pp=2, dp_replicate=2), [PipelineSplit(schedule="interleaved_1f1b",
                                                                              virtual_stages=2, microbatches=4),
                                                                DataParallel("ddp")], 4, False),
        "cp2 ring fsdp2": (dict(dp_shard=2, cp=2), [ContextParallel(method="ring"), DataParallel("fsdp")], 1, False),
        "cp2 a2a fsdp2": (dict(dp_shard=2, cp=2), [ContextParallel(method="a2a"), DataParallel("fsdp")], 1, False),
        "ep2 fsdp2 (MoE)": (dict(dp_shard=2, ep=2), [ExpertParallel(dispatcher="alltoall"), DataParallel("fsdp")], 1,
                            True),
        "fsdp4 full recompute": (dict(dp_shard=4), [Recompute("full"), DataParallel("fsdp")], 1, False),
        "tp2 ddp2 selective": (dict(dp_replicate=2, tp=2), [TensorParallel(), Recompute("selective"),
                                                            DataParallel("ddp")], 1, False),
    }


def model_config(moe: bool):
    from dtmega.models import LlamaConfig
    from dtmega.models.moe_config import MoEConfig

    return LlamaConfig(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, ffn_dim=1536, rope_theta=10000.0,
                       rope_scaling=None, max_seq_len=SEQ,
                       moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=768, aux_loss_coeff=0.0, grouped_gemm=False,
                                     capacity_factor=1.0)
                       if moe else None)


def worker(names: list[str], out: Path) -> None:
    from tensordict import TensorDict

    import dtmega
    from dtmega.cost.memory_count import step_peak_bytes
    from dtmega.models import Llama
    from dtmega.train.optim import adamw

    rows = []
    for name in names:
        sizes, passes, microbatches, moe = plans()[name]
        config = model_config(moe)
        torch.manual_seed(0)
        mesh = dtmega.make_mesh(**sizes)
        pm = dtmega.parallelize(Llama(config), mesh, passes)
        optimizer = adamw(pm.module, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8)
        generator = torch.Generator().manual_seed(1)
        local = MICRO_BATCH * microbatches

        def step():
            tokens = torch.randint(0, config.vocab_size, (local * pm.dp_size, SEQ + 1), generator=generator)
            batch = TensorDict({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}, batch_size=[local * pm.dp_size, SEQ])
            pm.forward_backward(pm.shard_batch(batch))
            optimizer.step()
            pm.after_optimizer_step()
            optimizer.zero_grad(set_to_none=True)

        step()  # warm-up: the optimizer's state exists from here on
        peak = step_peak_bytes(step, pm.module, optimizer, torch.device("cpu"))
        times = []
        for _ in range(STEPS):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        peaks, slowest = [None] * dist.get_world_size(), [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
        dist.all_gather_object(slowest, statistics.median(times))
        rows.append({"plan": name, "measured_gib": max(peaks) / 2**30, "measured_s": max(slowest),
                     "measured_gib_per_rank": [p / 2**30 for p in peaks]})
        pm = optimizer = step = None  # nothing of this plan stays alive into the next
        __import__("gc").collect()  # the next plan starts from nothing this one left
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows))


def predict(row: dict, hardware: Path) -> dict:
    """The cost model's figures for a measured row (check_plan on the meta device)."""
    import dtmega
    from dtmega.models import Llama
    from dtmega.passes import Workload

    sizes, passes, microbatches, moe = plans()[row["plan"]]
    with torch.device("meta"):
        model = Llama(model_config(moe))
    cost = dtmega.check_plan(model, sizes, passes,
                             workload=Workload(SEQ, MICRO_BATCH, microbatches if microbatches > 1 else None),
                             hardware=str(hardware)).cost
    return {**row, "predicted_gib": cost.memory.peak / 2**30, "predicted_s": cost.step_s,
            "predicted": {k: v / 2**20 for k, v in cost.memory.rows()}, "plan_shape": cost.plan.describe()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", type=Path, default=None, help="a `dtmega calibrate --ranks 4` file")
    parser.add_argument("--plans", nargs="*", default=None, help="subset of plans (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cost_model.json")
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--reuse", type=Path, help="a results JSON whose measurements to predict again (no run)")
    args = parser.parse_args(argv)
    names = args.plans or list(plans())
    if args.worker_out:
        run_worker(worker, names, args.worker_out)
        return {}
    hardware = args.hardware
    if hardware is None:  # measured now, beside the run: a shared machine's speed drifts over minutes
        hardware = args.out.with_name("cpu4.toml")
        hardware.unlink(missing_ok=True)
        subprocess.run([sys.executable, "-m", "dtmega", "calibrate", "--ranks", "4", "--out", str(hardware)], check=True)
    if args.reuse:  # predictions again for the measurements of an earlier run
        rows = [{k: v for k, v in row.items() if k.startswith("measured") or k == "plan"}
                for row in json.loads(args.reuse.read_text())["rows"]]
    else:
        rows = run_on_ranks(__file__, 4, args.out.with_suffix(".rows.json"), "--plans", *names)
    rows = [predict(row, hardware) for row in rows]
    table = Table(title=f"cost model vs measured, 4 CPU ranks, seq {SEQ}, micro-batch {MICRO_BATCH}, fp32")
    for column in ("plan", "predicted MiB", "measured MiB", "ratio", "predicted s", "measured s", "ratio"):
        table.add_column(column, justify="left" if column == "plan" else "right")
    for row in rows:
        row["memory_ratio"] = row["predicted_gib"] / row["measured_gib"]
        row["time_ratio"] = row["predicted_s"] / row["measured_s"]
        table.add_row(row["plan"], f"{row['predicted_gib'] * 1024:.1f}", f"{row['measured_gib'] * 1024:.1f}",
                      f"{row['memory_ratio']:.2f}", f"{row['predicted_s']:.3f}", f"{row['measured_s']:.3f}",
                      f"{row['time_ratio']:.2f}")
    console().print(table)
    # ranking: every pair of plans whose measured times differ by more than 10 % must be
    # ordered the same way by the predictions
    pairs, disagree = 0, []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if abs(a["measured_s"] - b["measured_s"]) / min(a["measured_s"], b["measured_s"]) <= 0.10:
                continue
            pairs += 1
            if (a["measured_s"] < b["measured_s"]) != (a["predicted_s"] < b["predicted_s"]):
                disagree.append(f"{a['plan']} vs {b['plan']}")
    console().print(f"ranking: {pairs} pairs of plans apart by more than 10 % measured, {len(disagree)} ordered "
                    f"otherwise by the prediction{': ' + '; '.join(disagree) if disagree else ''}", highlight=False)
    result = {"command": " ".join(["python", "benchmarks/cost_model.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine(), "hardware": str(hardware), "hardware_file": Path(hardware).read_text(),
              "rows": rows, "ranking_pairs": pairs, "ranking_disagreements": disagree}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
