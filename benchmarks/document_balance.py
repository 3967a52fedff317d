"""Context parallelism on packed documents: how evenly ring / all-gather attention spreads the
work over the CP ranks, and how many blocks it skips, by how the tokens are dealt.

    python benchmarks/document_balance.py            # seq 16384, CP 2/4/8, 4 samples of mixed documents

For each sample (document lengths drawn from a long-tailed mix: many short documents, a few
of thousands of tokens) and each CP size, three deals of the tokens to the ranks:

- contiguous: rank r holds the r-th S/cp tokens (`ContextParallel(load_balance=None)`);
- zigzag: chunks r and 2cp-1-r of 2cp, which balances one causal sequence (shown for reference);
- documents: dtmega's document-aware deal (`load_balance="zigzag"` with DocumentMasking,
  kernels/document_shards.py).

Work is the query-key pairs a rank's queries attend within their documents, counted from the
very block parts the kernels compute (kernels/context_blocks.py); "max/mean" is the most loaded
rank against the mean (the step waits for the slowest rank). "skipped" is the (query shard x
key shard) blocks that share no document and are never computed, of cp² per sample. With
`--measure` (the default) each rank's attention forward and backward is also timed, rank after
rank in this one process with the fused CPU block kernel (4 heads of 64; the faster of two runs
after a warm-up), so the balance is shown in seconds too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine  # noqa: E402
from dtmega.kernels.attention_blocks import attend, attend_backward  # noqa: E402
from dtmega.kernels.context_blocks import document_blocks  # noqa: E402
from dtmega.kernels.context_shards import token_indices  # noqa: E402
from dtmega.kernels.document_shards import shard_documents  # noqa: E402
from dtmega.printing import console  # noqa: E402

DEALS = ("contiguous", "zigzag", "documents")


def mixed_lengths(seq: int, seed: int) -> list[int]:
    """Document lengths filling `seq`: 70 % short (1-256 tokens), 25 % medium (256-2048), 5 %
    long (2048-8192), the last one cut to fit."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < seq:
        kind = float(torch.rand((), generator=generator))
        low, high = (1, 256) if kind < 0.70 else (256, 2048) if kind < 0.95 else (2048, 8192)
        lengths.append(int(torch.randint(low, high + 1, (), generator=generator)))
    lengths[-1] -= sum(lengths) - seq
    return [length for length in lengths if length > 0]


def deal(lengths: list[int], world: int, how: str) -> torch.Tensor:
    """[world, S/cp] token positions per rank."""
    seq = sum(lengths)
    if how == "zigzag":
        return torch.stack([token_indices(seq, world, rank, True) for rank in range(world)])
    return shard_documents(lengths, world, balanced=how == "documents").positions


def blocks_for(lengths: list[int], positions: torch.Tensor):
    """The kernels' block parts for one sample dealt as `positions`."""
    starts = torch.repeat_interleave(torch.tensor([sum(lengths[:i]) for i in range(len(lengths))]),
                                     torch.tensor(lengths))
    return document_blocks(positions[:, None], starts[positions][:, None])


def rank_seconds(blocks, world: int, n: int, heads: int, dim: int) -> list[float]:
    """Each rank's attention forward + backward over its parts, timed one rank at a time."""
    generator = torch.Generator().manual_seed(0)
    shards = [(torch.randn(1, heads, n, dim, generator=generator), torch.randn(2, 1, heads, n, dim, generator=generator))
              for _ in range(world)]

    def once(rank: int) -> float:
        q, _ = shards[rank]
        start = time.perf_counter()
        out, lse = attend(q, ((shards[owner][1], blocks.parts(rank, owner)) for owner in range(world)), dim**-0.5)
        dq = torch.zeros_like(q)
        for owner in range(world):
            attend_backward(torch.ones_like(out), q, out, lse, shards[owner][1], blocks.parts(rank, owner), dim**-0.5,
                            None, dq, torch.zeros_like(shards[owner][1]))
        return time.perf_counter() - start

    once(0)  # warm-up
    return [min(once(rank) for _ in range(2)) for rank in range(world)]


def measure(args) -> list[dict]:
    """One row per (CP size, deal): work and skipped blocks over the samples, and seconds."""
    samples = [mixed_lengths(args.seq, seed) for seed in range(args.samples)]
    rows = []
    for world in args.cp:
        for how in DEALS:
            ratios, skipped, pairs, time_ratios = [], 0, 0, []
            for lengths in samples:
                blocks = blocks_for(lengths, deal(lengths, world, how))
                work = [blocks.work(rank) for rank in range(world)]
                ratios.append(max(work) / statistics.mean(work))
                skipped += sum(not blocks.parts(r, o) for r in range(world) for o in range(world))
                pairs += sum(work)
                if args.measure:
                    seconds = rank_seconds(blocks, world, args.seq // world, args.heads, args.dim)
                    time_ratios.append(max(seconds) / statistics.mean(seconds))
            rows.append({"cp": world, "deal": how, "work_max_over_mean": max(ratios),
                         "work_max_over_mean_median": statistics.median(ratios),
                         "blocks_skipped": skipped, "blocks": world * world * len(samples), "pairs": pairs,
                         "seconds_max_over_mean": max(time_ratios) if time_ratios else None})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--measure", action=argparse.BooleanOptionalAction, default=True,
                        help="also time each rank's attention (--no-measure: count only)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "document_balance.json")
    args = parser.parse_args(argv)
    rows = measure(args)
    causal_pairs = args.seq * (args.seq + 1) // 2 * args.samples
    table = Table(title=f"CP attention work on packed documents: seq {args.seq}, {args.samples} samples of mixed "
                        "documents (worst sample shown)")
    for column in ("cp", "deal", "work max/mean", "seconds max/mean", "blocks skipped", "pairs vs causal"):
        table.add_column(column, justify="left" if column == "deal" else "right")
    for row in rows:
        seconds = "-" if row["seconds_max_over_mean"] is None else f"{row['seconds_max_over_mean']:.3f}"
        table.add_row(str(row["cp"]), row["deal"], f"{row['work_max_over_mean']:.3f}", seconds,
                      f"{row['blocks_skipped']} of {row['blocks']}", f"{row['pairs'] / causal_pairs:.1%}")
    console().print(table)
    result = {"command": " ".join(["python", "benchmarks/document_balance.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine(), "torch": torch.__version__, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    console().print(f"wrote {args.out}", highlight=False)
    return result


if __name__ == "__main__":
    main()
