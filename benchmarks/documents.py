"""Packed documents: a training step with document masking against the causal step on the same
tokens, by document-masking backend.

    python benchmarks/documents.py                         # CPU: seq 2048, 8 documents per sample
    python benchmarks/documents.py --seq 8192 --device cuda # a GPU: FlexAttention, varlen, dense mask

One process, dtmega's Llama (width 256, 4 blocks, 8 heads / 4 KV on CPU; width 2048, 8 blocks,
16 / 8 on CUDA in bf16), AdamW. Each row: the median step time of `--steps` timed steps after
warm-up, tokens/s, and the bytes autograd saves in one block's attention core. "causal" is the
plain model on the same tokens (attention across the packed documents: the speed reference, not
the same result). FlexAttention trains on CUDA only (torch has no CPU backward for it).
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


def document_lengths(seq: int, documents: int, seed: int) -> list[int]:
    """`documents` lengths of random size summing to `seq` (each at least 1)."""
    generator = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(seq - 1, generator=generator)[:documents - 1].add(1).tolist())
    bounds = [0, *cuts, seq]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def run(backend: str | None, args, device: torch.device) -> dict:
    """Median step time of the model with `backend` document masking (None: causal)."""
    import dtmega
    from dtmega.kernels import per_token_cross_entropy
    from dtmega.models import Llama, LlamaConfig

    cuda = device.type == "cuda"
    config = LlamaConfig(dim=2048 if cuda else 256, n_layers=8 if cuda else 4, n_heads=16 if cuda else 8,
                         n_kv_heads=8 if cuda else 4, ffn_dim=5632 if cuda else 768, vocab_size=32000 if cuda else 2048,
                         max_seq_len=args.seq)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    if backend is not None:
        model.document_backend = backend
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lengths = [document_lengths(args.seq, args.documents, seed=row) for row in range(args.batch)]
    ids = dtmega.document_ids_from_lengths(lengths, args.seq).to(device)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
    dtype = torch.bfloat16 if cuda else torch.float32

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=cuda):
            logits = model(tokens, document_ids=ids if backend is not None else None)
            loss = per_token_cross_entropy(logits, tokens.roll(-1, 1)).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for index in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"backend": backend or "causal", "step_s": seconds, "tokens_per_s": args.batch * args.seq / seconds,
            "spread": (max(times) - min(times)) / seconds, "lengths": lengths,
            "attention_saved_bytes": _core_saved_bytes(model, tokens[:1], ids[:1] if backend else None, dtype, cuda)}


def _core_saved_bytes(model, tokens, ids, dtype, cuda: bool) -> int:
    """Bytes autograd keeps for backward inside the first block's attention core (one sample)."""
    core = model.layers["0"].attention.core
    saved: list[int] = []
    inside = [False]

    def pack(tensor):
        if inside[0]:
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    def enter(*_):
        inside[0] = True

    def leave(*_):
        inside[0] = False

    handles = [core.register_forward_pre_hook(enter), core.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cuda" if cuda else "cpu", dtype=dtype, enabled=cuda):
            model(tokens, document_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    return sum(saved)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--documents", type=int, default=8, help="documents per sample")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--backends", nargs="*", default=None,
                        help="document-masking backends (default: varlen and sdpa on CPU, also flex on CUDA)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "documents.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    backends = args.backends if args.backends is not None else (["flex", "varlen", "sdpa"] if device.type == "cuda"
                                                                 else ["varlen", "sdpa"])
    rows = [run(None, args, device)] + [run(backend, args, device) for backend in backends]
    causal = rows[0]["step_s"]
    table = Table(title=f"packed documents vs causal: seq {args.seq}, {args.documents} documents per sample, "
                        f"batch {args.batch}, {args.device}")
    for column in ("attention", "step s", "vs causal", "tokens/s", "spread", "core saves (MiB)"):
        table.add_column(column, justify="left" if column == "attention" else "right")
    for row in rows:
        row["vs_causal"] = row["step_s"] / causal
        table.add_row(row["backend"], f"{row['step_s']:.3f}", f"{row['vs_causal']:.2f}x", f"{row['tokens_per_s']:,.0f}",
                      f"{row['spread']:.0%}", f"{row['attention_saved_bytes'] / 2**20:.2f}")
    console().print(table)
    result = {"command": " ".join(["python", "benchmarks/documents.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    console().print(f"wrote {args.out}", highlight=False)
    return result


if __name__ == "__main__":
    main()
