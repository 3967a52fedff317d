"""Whole-step capture against the eager step: `dtmega.capture_step` (forward, backward and the
AdamW step compiled as one program; CUDA graphs on a GPU) and the same step run eagerly, on the
same model, batches and seeds.

    python benchmarks/step_capture.py                          # CPU: aot_eager (a smoke run, not a result)
    python benchmarks/step_capture.py --device cuda            # a GPU: inductor + CUDA graphs, bf16 weights

One process, one rank, dtmega's Llama (CPU: width 128, 1 block; CUDA: width 1024, 8 blocks, bf16),
seq `--seq`, batch `--batch`. Each row: the median step time of `--steps` timed steps after
`--warmup` (compilation happens there), tokens/s, the run-to-run spread, and the worst relative
difference of the captured run's losses from the eager run's.
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
from dtmega.printing import console  # noqa: E402


def run(captured: bool, args, device: torch.device) -> dict:
    """Step times and losses of the eager or the captured step."""
    import dtmega
    from dtmega.models import Llama, LlamaConfig
    from dtmega.passes import Plan

    cuda = device.type == "cuda"
    config = LlamaConfig(dim=1024 if cuda else 128, n_layers=8 if cuda else 1, n_heads=16 if cuda else 4,
                         n_kv_heads=8 if cuda else 2, ffn_dim=2816 if cuda else 256, vocab_size=32000 if cuda else 1024,
                         max_seq_len=args.seq)
    with torch.device("meta"):
        model = Llama(config)
    pm = dtmega.parallelize(model.to(torch.bfloat16 if cuda else torch.float32),
                            dtmega.make_mesh(device_type=device.type), Plan([]))
    pm.init_weights(seed=0)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=torch.tensor(1e-4, device=device), eps=1e-6,
                                  capturable=cuda, foreach=cuda)
    backend = args.backend or ("inductor" if cuda else "aot_eager")
    step = dtmega.capture_step(pm, optimizer, backend=backend) if captured else None
    times, losses = [], []
    for index in range(args.warmup + args.steps):
        batch = dtmega.synthetic_batch(args.batch, args.seq, config.vocab_size, seed=index, device=device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if step is not None:
            loss = step(batch)
        else:
            optimizer.zero_grad(set_to_none=True)
            loss = pm.forward_backward(batch)
            optimizer.step()
            pm.after_optimizer_step()
        if cuda:
            torch.cuda.synchronize()
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    seconds = statistics.median(times)
    return {"step": f"captured ({backend})" if captured else "eager", "step_s": seconds,
            "tokens_per_s": args.batch * args.seq / seconds, "spread": (max(times) - min(times)) / seconds,
            "losses": losses, "capture": step.describe() if step is not None else None}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: inductor on CUDA, "
                                                        "aot_eager on CPU)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "step_capture.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = [run(False, args, device), run(True, args, device)]
    eager = rows[0]
    table = Table(title=f"whole-step capture vs eager: seq {args.seq}, batch {args.batch}, {args.device}")
    for column in ("step", "step s", "vs eager", "tokens/s", "spread", "loss vs eager"):
        table.add_column(column, justify="left" if column == "step" else "right")
    for row in rows:
        row["vs_eager"] = eager["step_s"] / row["step_s"]
        row["loss_vs_eager"] = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], eager["losses"]))
        table.add_row(row["step"], f"{row['step_s']:.4f}", f"{row['vs_eager']:.2f}x", f"{row['tokens_per_s']:,.0f}",
                      f"{row['spread']:.0%}", f"{row['loss_vs_eager']:.1e}")
    console().print(table)
    result = {"command": " ".join(["python", "benchmarks/step_capture.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    console().print(f"wrote {args.out}", highlight=False)
    return result


if __name__ == "__main__":
    main()
