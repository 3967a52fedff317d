"""Context parallelism: activation memory and step time vs cp, and bytes sent vs the analytic volume.

    python benchmarks/context.py                   # seq 4096, cp 1/2/4; table + benchmarks/results/context.json

For each cp (a torchrun job of cp ranks, one sequence split over all of them) and method, one
training step of a 2-block Llama: the activation memory of a rank is the bytes of the tensors
autograd saves for backward (counted once per storage), the step time is the median of a few
steps, and the bytes sent are those of the context-parallel attention (forward and backward)
against the closed-form volume of each method. 4 ranks share 2 cores here, so step times compare
methods at one cp, not cp sizes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, run_on_ranks, run_worker, saved_activation_bytes, timed_steps  # noqa: E402
from dtmega.passes.context_parallel import SequenceSharding  # noqa: E402
from dtmega.printing import console  # noqa: E402

DIM, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 8, 4, 2, 512


def analytic_bytes(method: str, cp: int, seq: int, batch: int = 1, element: int = 4) -> int:
    """Bytes one rank sends per step (forward + backward) for the attention of all blocks."""
    if cp == 1:
        return 0
    head_dim = DIM // HEADS
    local = batch * (seq // cp) * head_dim
    q, kv = local * HEADS * element, 2 * local * KV_HEADS * element
    if method == "ring":  # K/V forward and backward (cp-1 hops), dK/dV (fp32) home in cp hops
        per_layer = 2 * (cp - 1) * kv + cp * 2 * local * KV_HEADS * 4
    elif method == "all_gather":  # all-gather K/V, reduce-scatter dK/dV
        per_layer = 2 * (cp - 1) * kv
    else:  # a2a: q, k, v and the output each way, forward and backward; (cp-1)/cp of each leaves
        kv_heads = KV_HEADS if KV_HEADS % cp == 0 else HEADS
        tensors = 2 * q + 2 * local * kv_heads * element
        per_layer = 2 * tensors * (cp - 1) // cp
    return LAYERS * per_layer


def worker(seq: int, methods: list[str], steps: int, out: Path) -> None:
    import dtmega
    from dtmega.kernels import per_token_cross_entropy
    from dtmega.models import Llama, LlamaConfig
    from dtmega.passes import ContextParallel, DataParallel, Plan

    cp = dist.get_world_size()
    config = LlamaConfig(dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=VOCAB, ffn_dim=4 * DIM,
                         max_seq_len=seq, rope_scaling=None)
    batch = dtmega.synthetic_batch(1, seq, VOCAB)
    rows = []
    for method in (methods if cp > 1 else ["none"]):
        with torch.device("meta"):
            model = Llama(config)
        passes = [ContextParallel(method=method), DataParallel("ddp")] if cp > 1 else []
        pm = dtmega.parallelize(model, dtmega.make_mesh(cp=cp, dp_shard=1, device_type="cpu"), Plan(passes))
        pm.init_weights(seed=0)
        sharding = pm.hook(SequenceSharding)
        stats = sharding.comm if sharding else None
        fields = pm.prepare_batch(batch)  # this rank's sequence shard
        activation, _ = saved_activation_bytes(
            lambda: per_token_cross_entropy(pm.forward(fields.tokens, fields.position_ids), fields.labels).sum()
        )

        def step():
            pm.forward_backward(batch)
            pm.module.zero_grad(set_to_none=True)

        times, sent = timed_steps(step, stats, steps + 1)
        rows.append({"cp": cp, "method": method, "seq": seq, "activation_mib": activation / 2**20,
                     "step_seconds": statistics.median(times[1:]), "bytes_sent": sent[-1],
                     "analytic_bytes": analytic_bytes(method, cp, seq)})
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--methods", nargs="+", default=["ring", "all_gather", "a2a"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "context.json")
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_out:
        run_worker(worker, args.seq, args.methods, args.steps, args.worker_out)
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for cp in args.cp:
        rows += run_on_ranks(__file__, cp, args.out.with_suffix(f".cp{cp}.json"), "--seq", str(args.seq),
                             "--steps", str(args.steps), "--methods", *args.methods)
    result = {"command": " ".join([sys.executable, *sys.argv]), "machine": machine(), "runs": rows}
    args.out.write_text(json.dumps(result, indent=2))
    table = Table(title=f"context parallelism, one sequence of {args.seq} tokens, {LAYERS} blocks x width {DIM}")
    for column in ("cp", "method", "activation MiB/rank", "step (s)", "MB sent/rank/step", "analytic MB", "ratio"):
        table.add_column(column, justify="right")
    for row in rows:
        ratio = f"{row['bytes_sent'] / row['analytic_bytes']:.3f}" if row["analytic_bytes"] else "-"
        table.add_row(str(row["cp"]), row["method"], f"{row['activation_mib']:.1f}", f"{row['step_seconds']:.3f}",
                      f"{row['bytes_sent'] / 1e6:.2f}", f"{row['analytic_bytes'] / 1e6:.2f}", ratio)
    console().print(table)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
