"""What checkpoint manifests cost: the CRC-32 of every file at save, and its verification at load,
against the save and load themselves, on the demo model (`make train`'s: 4 layers, width 256,
vocabulary 8192, 7.1 M parameters; weights and AdamW's two moments in fp32) and on a wider one.

    python benchmarks/checkpoint_checksums.py                  # demo model and width 1024
    python benchmarks/checkpoint_checksums.py --widths 256 --repeats 5

One process, one rank (at N ranks each rank hashes its own shards at save, and the files are
dealt out over the ranks at load: the per-rank cost divides by N). The files are read back
from the page cache, as they are right after a save; a cold read is bounded by the disk, the
same for the load itself. Writes benchmarks/results/checkpoint_checksums.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import dtmega  # noqa: E402
from benchmarks.common import machine  # noqa: E402
from dtmega.mesh import init_distributed  # noqa: E402
from dtmega.models import model_spec  # noqa: E402
from dtmega.passes import Plan  # noqa: E402
from dtmega.printing import console  # noqa: E402
from dtmega.train.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from dtmega.train.checkpoint_manifest import verify_checkpoint, write_manifest  # noqa: E402

DEMO = {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 8192, "ffn_dim": 768,
        "max_seq_len": 128, "tie_embeddings": False}


def _median_seconds(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(width: int, repeats: int, root: Path) -> dict:
    """Seconds of save, manifest, load and verification (sizes; sizes and CRC-32) for a Llama of
    the demo's shape at `width`."""
    spec = model_spec("llama")
    config = spec.config_from_dict({**DEMO, "dim": width, "ffn_dim": 3 * width})
    model = spec.instantiate(config, seed=0)
    pm = dtmega.parallelize(model, dtmega.make_mesh(device_type="cpu"), Plan([]))
    if spec.materialize == "meta":
        pm.init_weights(seed=0)
    model = pm.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, DEMO["vocab_size"], (2, 16))).float().mean().backward()
    optimizer.step()  # the moments exist, as in a real checkpoint
    parameters = sum(p.numel() for p in model.parameters())
    save_root = root / f"w{width}"
    checkpoint = save_checkpoint(save_root, 1, model, optimizer, {"iteration": 1})
    files = [p for p in checkpoint.iterdir() if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    row = {
        "width": width, "parameters": parameters, "checkpoint_mib": size / 2**20, "files": len(files),
        "save_s": _median_seconds(lambda: save_checkpoint(save_root, 1, model, optimizer, {"iteration": 1}), repeats),
        "manifest_s": _median_seconds(lambda: write_manifest(checkpoint, [".metadata", "state.json"]), repeats),
        "load_s": _median_seconds(lambda: load_checkpoint(checkpoint, model, optimizer), repeats),
        "verify_sizes_s": _median_seconds(lambda: verify_checkpoint(checkpoint, contents=False), repeats),
        "verify_crc32_s": _median_seconds(lambda: verify_checkpoint(checkpoint, contents=True), repeats),
    }
    assert verify_checkpoint(checkpoint).intact
    row["manifest_share_of_save"] = row["manifest_s"] / row["save_s"]
    row["verify_share_of_load"] = row["verify_crc32_s"] / row["load_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint_checksums.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    init_distributed("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(width, args.repeats, Path(tmp)) for width in args.widths]
    table = Table(title="checkpoint checksums (CRC-32), one rank, median of repeats")
    for column in ("width", "parameters", "MiB", "save s", "manifest s", "% of save", "load s", "verify sizes s",
                   "verify crc32 s", "% of load"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["width"]), f"{r['parameters']:,}", f"{r['checkpoint_mib']:.1f}", f"{r['save_s']:.3f}",
                      f"{r['manifest_s']:.3f}", f"{100 * r['manifest_share_of_save']:.1f}", f"{r['load_s']:.3f}",
                      f"{r['verify_sizes_s']:.4f}", f"{r['verify_crc32_s']:.3f}", f"{100 * r['verify_share_of_load']:.1f}")
    console().print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "machine": machine(), "rows": rows}, indent=2))
    console().print(f"wrote {out}")


if __name__ == "__main__":
    main()
