"""Mixture of experts: token-dispatch bytes per step vs the analytic volume, tokens/s and memory
per rank, for EP 1, 2, 4, each dispatcher and routing.

    python benchmarks/moe.py                  # table + benchmarks/results/moe.json

Routing "topk" is plain top-2; "grouped" is DeepSeek-V3's group-limited routing with the 8
experts in 4 groups and each token's 2 experts from its best group (`num_groups=4,
group_topk=1`): under EP4 a group is a rank, so a token's experts lie on one rank. The flex
dispatcher sends a token once per rank it needs (not once per expert), so its bytes fall with
the groups; its analytic column is that bound (even routing), not an expectation.

For each EP size (a torchrun job of EP ranks, each with its own sequences: EP borrows
data-parallel ranks) and dispatcher, training steps of a 4-block MoE Llama (8 experts, top-2).
Bytes are what each rank hands to the token exchanges (forward and backward); the analytic
volume assumes evenly routed tokens, so measured / analytic > 1 shows routing imbalance (the
busiest expert's share is reported beside it). Dense weights are replicated (DDP) so the memory
shows what EP alone saves: parameters + gradients + AdamW state from the layout, activations
autograd saves, and peak resident memory. Ranks share the
machine's cores, so tokens/s compares dispatchers at one EP size.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, run_on_ranks, run_worker, saved_activation_bytes, timed_steps  # noqa: E402
from dtmega.passes.expert_parallel import ExpertDispatch  # noqa: E402
from dtmega.printing import console  # noqa: E402

DIM, LAYERS, HEADS, EXPERTS, TOP_K, EXPERT_FFN, VOCAB = 256, 4, 8, 8, 2, 512, 512


GROUPS, GROUP_TOPK = 4, 1  # the "grouped" routing


def analytic_bytes(dispatcher: str, ep: int, tokens: int, routing: str = "topk", element: int = 4) -> int:
    """Bytes one rank sends per step for token dispatch in all MoE layers, routing even (flex:
    the bound of one row per token and rank, at most the ranks its groups allow)."""
    if ep == 1:
        return 0
    if dispatcher == "flex":
        ranks = min(TOP_K, ep, GROUP_TOPK * max(1, ep // GROUPS)) if routing == "grouped" else min(TOP_K, ep)
        per_layer = tokens * ranks * (ep - 1) // ep * (4 * DIM * element + TOP_K * (8 + 2 * element))
    elif dispatcher == "alltoall":  # rows to remote experts, there and back, forward and backward
        per_layer = 4 * tokens * TOP_K * (ep - 1) // ep * DIM * element
    else:  # gather tokens (+ expert ids, int64, and weights), reduce-scatter outputs; and backward
        per_layer = (ep - 1) * tokens * (4 * DIM * element + TOP_K * (8 + 2 * element))
    return LAYERS * per_layer


def worker(seq: int, batch: int, dispatchers: list[str], steps: int, out: Path, routings: tuple = ("topk",)) -> None:
    import dtmega
    from dtmega.kernels import per_token_cross_entropy
    from dtmega.models import Llama, LlamaConfig
    from dtmega.models.moe_config import MoEConfig
    from dtmega.passes import DataParallel, ExpertParallel, Plan

    ep = dist.get_world_size()
    rows = []
    for routing, dispatcher in [(r, d) for r in routings for d in (dispatchers if ep > 1 else ["local"])]:
        groups = dict(num_groups=GROUPS, group_topk=GROUP_TOPK) if routing == "grouped" else {}
        config = LlamaConfig(dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=HEADS, vocab_size=VOCAB,
                             ffn_dim=4 * DIM, max_seq_len=seq, rope_scaling=None,
                             moe=MoEConfig(num_experts=EXPERTS, top_k=TOP_K, ffn_dim=EXPERT_FFN, aux_loss_coeff=1e-2,
                                           **groups))
        with torch.device("meta"):
            model = Llama(config)
        # DDP for the dense weights, so the memory column shows what EP alone saves.
        passes = [ExpertParallel(dispatcher=dispatcher), DataParallel("ddp")] if ep > 1 else []
        mesh = dtmega.make_mesh(ep=ep, dp_shard=1, device_type="cpu")
        pm = dtmega.parallelize(model, mesh, Plan(passes))
        pm.init_weights(seed=0)
        optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        dispatch = pm.hook(ExpertDispatch)
        stats = dispatch.comm if dispatch else None
        local = dtmega.synthetic_batch(batch, seq, VOCAB, seed=dist.get_rank())
        fields = dtmega.batch.unpack_batch(local)
        activation, _ = saved_activation_bytes(
            lambda: per_token_cross_entropy(pm.forward(fields.tokens, fields.position_ids), fields.labels).sum()
        )
        pm.module.zero_grad(set_to_none=True)
        pm.moe_stats()

        def step():
            pm.forward_backward(local)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        times, sent = timed_steps(step, stats, steps + 1)
        load = pm.moe_stats()["expert_load"]
        busiest = max(max(layer) for layer in load.values()) * EXPERTS
        weights = pm.layout.local_bytes()  # parameters; + fp32 gradients + AdamW's two moments
        rows.append({"ep": ep, "dispatcher": dispatcher, "routing": routing, "seq": seq, "batch_per_rank": batch,
                     "tokens_per_s": ep * batch * seq / statistics.median(times[1:]),
                     "step_seconds": statistics.median(times[1:]), "weights_mib": weights / 2**20,
                     "weights_grads_adam_mib": 4 * weights / 2**20, "activation_mib": activation / 2**20,
                     "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                     "bytes_sent": statistics.mean(sent[1:]),
                     "analytic_bytes": analytic_bytes(dispatcher, ep, batch * seq, routing),
                     "busiest_expert_share": busiest})
    everyone: list = [None] * ep
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() == 0:  # per-rank figures: the worst rank's bytes and memory, rank 0's speed
        for i, row in enumerate(rows):
            row["bytes_sent"] = max(r[i]["bytes_sent"] for r in everyone)
            row["peak_rss_mib"] = max(r[i]["peak_rss_mib"] for r in everyone)
        out.write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dispatchers", nargs="+", default=["alltoall", "allgather", "flex"])
    parser.add_argument("--routing", nargs="+", default=["topk", "grouped"], choices=("topk", "grouped"))
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "moe.json")
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_out:
        run_worker(worker, args.seq, args.batch, args.dispatchers, args.steps, args.worker_out, tuple(args.routing))
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for ep in args.ep:
        rows += run_on_ranks(__file__, ep, args.out.with_suffix(f".ep{ep}.json"), "--seq", str(args.seq),
                             "--batch", str(args.batch), "--steps", str(args.steps), "--dispatchers", *args.dispatchers,
                             "--routing", *args.routing)
    result = {"command": " ".join([sys.executable, *sys.argv]), "machine": machine(), "runs": rows}
    args.out.write_text(json.dumps(result, indent=2))
    table = Table(title=f"MoE, {LAYERS} blocks x width {DIM}, {EXPERTS} experts top-{TOP_K}, {args.batch} x {args.seq} "
                        "tokens per rank")
    for column in ("ep", "routing", "dispatcher", "tokens/s", "weights+grads+Adam MiB/rank", "activations MiB", "peak RSS MiB",
                   "MB sent/rank/step", "analytic MB", "ratio", "busiest expert"):
        table.add_column(column, justify="right")
    for row in rows:
        ratio = f"{row['bytes_sent'] / row['analytic_bytes']:.3f}" if row["analytic_bytes"] else "-"
        table.add_row(str(row["ep"]), row["routing"], row["dispatcher"], f"{row['tokens_per_s']:,.0f}",
                      f"{row['weights_grads_adam_mib']:.1f}", f"{row['activation_mib']:.1f}", f"{row['peak_rss_mib']:.0f}",
                      f"{row['bytes_sent'] / 1e6:.2f}", f"{row['analytic_bytes'] / 1e6:.2f}", ratio,
                      f"{row['busiest_expert_share']:.2f}x")
    console().print(table)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
