"""`dtmega serve` under a bounded load on loopback: C clients each sending R requests in turn
(all at once: the engine batches them), then the same requests one at a time. Reports errors,
p50/p99 latency and generated tokens per second of each, and the batched/one-at-a-time
throughput ratio (measured in the same run, on the same server).

    make train                                 # the demo checkpoint, if not there yet
    python benchmarks/serve.py                 # 32 clients x 8 requests of 32 tokens
    python benchmarks/serve.py --clients 8 --requests 4 --tokens 16 --load runs/demo/checkpoints

Every request is greedy with a fixed length (stop_token -1), so both phases generate the same
tokens. Stops by itself; writes benchmarks/results/serve.json with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine  # noqa: E402
from dtmega.printing import console  # noqa: E402
from dtmega.serve.process import ServerProcess  # noqa: E402

PROMPTS = ["And God said", "In the beginning", "The LORD is my shepherd", "And it came to pass", "Blessed are",
           "Then Jesus", "And the king said unto", "Behold, I"]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_phase(server: ServerProcess, bodies: list[list[dict]]) -> dict:
    """Each inner list is one client's requests, sent in turn; the clients run together."""
    latencies: list[float] = []
    errors: list[str] = []
    tokens = [0]
    lock = threading.Lock()

    def client(requests: list[dict]) -> None:
        for body in requests:
            start = time.perf_counter()
            try:
                status, answer = server.api(body, timeout=600)
            except OSError as error:
                status, answer = 0, {"message": str(error)}
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                if status != 200:
                    errors.append(f"{status}: {answer.get('message', answer)}")
                else:
                    tokens[0] += body["tokens_to_generate"] * len(body["prompts"])

    threads = [threading.Thread(target=client, args=(requests,)) for requests in bodies]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    return {"requests": len(latencies), "errors": len(errors), "first_errors": errors[:3], "seconds": wall,
            "p50_s": _percentile(latencies, 0.50), "p99_s": _percentile(latencies, 0.99),
            "mean_s": statistics.fmean(latencies), "tokens": tokens[0], "tokens_per_s": tokens[0] / wall}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", default=str(ROOT / "runs/demo/checkpoints"), help="checkpoint to serve")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=8, help="requests per client")
    p.add_argument("--tokens", type=int, default=32, help="tokens_to_generate per request")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/serve.json"))
    a = p.parse_args(argv)
    if not Path(a.load).exists():
        raise SystemExit(f"{a.load} does not exist. Fix: `make train` writes the demo checkpoint there, or pass --load")
    bodies = [[{"prompts": [PROMPTS[(c + r) % len(PROMPTS)]], "tokens_to_generate": a.tokens, "top_k": 1,
                "stop_token": -1} for r in range(a.requests)] for c in range(a.clients)]
    server = ServerProcess(["--load", a.load, "--max-batch-size", str(a.clients)], threads=None)
    try:
        run_phase(server, [[b] for b in bodies[0][:2]])  # warm-up
        batched = run_phase(server, bodies)
        health = server.health()
        one_at_a_time = run_phase(server, [[b for client in bodies for b in client]])
    finally:
        server.stop()
    ratio = batched["tokens_per_s"] / one_at_a_time["tokens_per_s"]
    table = Table(title=f"dtmega serve, {a.clients} clients x {a.requests} requests x {a.tokens} tokens ({a.load})")
    for column in ("phase", "requests", "errors", "p50 latency", "p99 latency", "seconds", "tokens/s"):
        table.add_column(column, justify="right" if column != "phase" else "left")
    for name, phase in (("batched (all clients at once)", batched), ("one at a time", one_at_a_time)):
        table.add_row(name, str(phase["requests"]), str(phase["errors"]), f"{phase['p50_s'] * 1000:.0f} ms",
                      f"{phase['p99_s'] * 1000:.0f} ms", f"{phase['seconds']:.1f}", f"{phase['tokens_per_s']:.0f}")
    console().print(table)
    console().print(f"batched / one at a time throughput: {ratio:.1f}x; the engine's forwards so far: "
                    f"{health['forwards']} for {health['generated_tokens']} tokens")
    result = {"command": " ".join(["python", "benchmarks/serve.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine(), "clients": a.clients, "requests_per_client": a.requests, "tokens": a.tokens,
              "checkpoint": a.load, "batched": batched, "one_at_a_time": one_at_a_time, "throughput_ratio": ratio}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
