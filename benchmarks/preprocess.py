"""Preprocessing throughput (MB/s) and peak memory by number of workers.

    python benchmarks/preprocess.py                          # 200 MB synthetic JSONL, byte tokenizer
    python benchmarks/preprocess.py --size-mb 50 --tokenizer bpe --workers 1 2

The input is streamed, so peak memory (the whole process tree: driver + workers) stays flat
as the input grows. Writes benchmarks/results/preprocess.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, run_measured  # noqa: E402
from dtmega.printing import console  # noqa: E402


def synthetic_jsonl(path: Path, size_mb: float, seed: int = 0) -> Path:
    """JSONL of random-word documents, about `size_mb` megabytes."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    target = int(size_mb * 1e6)
    with open(path, "w") as out:
        written = 0
        while written < target:
            text = " ".join(rng.choices(words, k=rng.randint(50, 400)))
            line = json.dumps({"text": text}) + "\n"
            out.write(line)
            written += len(line)
    return path


def measure(source: Path, workdir: Path, workers: int, tokenizer: str) -> dict:
    """One preprocessing run as a subprocess: seconds, MB/s, peak tree RSS."""
    command = [sys.executable, "-m", "dtmega", "preprocess", "--input", str(source), "--output-prefix",
               str(workdir / f"out_w{workers}"), "--workers", str(workers), "--append-eod", "--no-progress"]
    command += ["--tokenizer-type", "byte"] if tokenizer == "byte" else ["--train-tokenizer", "8192"]
    done, seconds, peak = run_measured(command, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(done.stderr)
    size = source.stat().st_size
    return {"workers": workers, "tokenizer": tokenizer, "input_mb": size / 1e6, "seconds": seconds,
            "mb_per_second": size / 1e6 / seconds, "peak_rss_mib": peak / 2**20}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "preprocess.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        source = synthetic_jsonl(Path(tmp) / "input.jsonl", args.size_mb)
        rows = [measure(source, Path(tmp), w, args.tokenizer) for w in args.workers]
    result = {"command": " ".join([sys.executable, *sys.argv]), "machine": machine(), "runs": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    table = Table(title=f"dtmega preprocess, {rows[0]['input_mb']:.0f} MB JSONL, {args.tokenizer} tokenizer")
    for column in ("workers", "seconds", "MB/s", "peak RSS (MiB, all processes)"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["workers"]), f"{row['seconds']:.1f}", f"{row['mb_per_second']:.1f}", f"{row['peak_rss_mib']:.0f}")
    console().print(table)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
