"""`dtmega calibrate`: measure this machine's ceilings and write a hardware file `dtmega plan
--gpu FILE`, `dtmega train --auto-plan --hardware FILE` and `check_plan(..., hardware=FILE)` read.

    dtmega calibrate --out runs/cpu.toml [--ranks 4] [--device cpu|cuda]

With `--ranks N` it starts N local processes (gloo on CPUs, nccl on GPUs) and measures what each
reaches while all run at once, as they do in training: the matmul rate by dtype (the best of a
few GEMM shapes), memory bandwidth (a large copy), the bus bandwidth and latency of an
all-reduce between them, and the fixed cost of one operator through autograd. Each rank's
figure is the median of repeats; the file holds the slowest rank's.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from pathlib import Path

import torch

from dtmega.cost.hardware import Hardware
from dtmega.kernels.errors import DtmegaError


class CalibrationError(DtmegaError):
    """Options `dtmega calibrate` cannot use; the message names the fix."""


def build_parser() -> argparse.ArgumentParser:
    """The options of `dtmega calibrate`."""
    parser = argparse.ArgumentParser(prog="dtmega calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="hardware TOML to write (never overwritten)")
    parser.add_argument("--ranks", type=int, default=1, help="local processes measured at once (the run's ranks per node)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--name", default=None, help="name in the file (default: the device's)")
    parser.add_argument("--seconds", type=float, default=0.3, help="time per measurement")
    return parser


def _timed(fn, seconds: float, sync, runs_wanted: int | None = None) -> float:
    """Median seconds of one call of `fn` over about `seconds` of repeats, or over exactly
    `runs_wanted` repeats (for collectives: every rank must make the same number of calls)."""
    fn()
    sync()
    runs = []
    deadline = time.perf_counter() + seconds
    while (len(runs) < runs_wanted) if runs_wanted else (time.perf_counter() < deadline or len(runs) < 3):
        start = time.perf_counter()
        fn()
        sync()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def matmul_flops(m: int, k: int, n: int, dtype: str, device: str, seconds: float) -> float:
    """FLOP/s of an [m, k] x [k, n] matmul in `dtype` on `device`: the median call over about
    `seconds` of repeats (the trainer's CPU MFU peak reads it too)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a = torch.randn(m, k, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(k, n, device=device, dtype=getattr(torch, dtype))
    return 2 * m * k * n / _timed(lambda: torch.mm(a, b), seconds, sync)


def measure_rank(device: str, seconds: float) -> dict[str, float]:
    """This process's figures (every rank runs it at the same time)."""
    import torch.distributed as dist

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    figures: dict[str, float] = {}
    shapes = [(2048, 512, 2048), (1024, 256, 1024), (512, 512, 512)] if device == "cpu" else \
        [(8192, 8192, 8192), (4096, 4096, 4096)]
    dtypes = ["float32", "bfloat16"] if device == "cpu" else ["bfloat16", "float32"]
    for dtype in dtypes:
        best = 0.0
        # most CPUs have no fast bf16 matmul: one small shape says so without minutes of waiting
        for m, k, n in shapes if device == "cuda" or dtype == "float32" else [(256, 256, 256)]:
            dist.barrier()
            best = max(best, matmul_flops(m, k, n, dtype, device, seconds))
        figures[f"flops_{dtype}"] = best
    big = torch.empty(64 * 2**20 // 4 if device == "cpu" else 2**28, device=device)
    copy = torch.empty_like(big)
    dist.barrier()
    figures["memory_bandwidth"] = 2 * big.numel() * 4 / _timed(lambda: copy.copy_(big), seconds, sync)
    x = torch.randn(1, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(50):
            y = y * 1.0001
        y.sum().backward()

    dist.barrier()
    figures["op_overhead"] = _timed(chain, seconds, sync) / 150  # 50 ops forward, ~2 per op backward (a floor)
    figures["sharded_op_overhead"] = _sharded_op_overhead(device, seconds)
    for index, reference in enumerate(REFERENCES):
        figures[f"reference_step_{index}"] = _reference_step(reference, device, seconds)
    n = dist.get_world_size()
    if n > 1:
        payload = torch.randn(4 * 2**20, device=device)  # 16 MiB
        dist.barrier()
        seconds_large = _timed(lambda: dist.all_reduce(payload), seconds, sync, runs_wanted=10)
        figures["bus_bandwidth"] = 2 * (n - 1) / n * payload.numel() * 4 / seconds_large
        tiny = torch.zeros(1, device=device)
        work = torch.randn(512, 512, device=device)

        def busy(collective: bool):
            # ranks that compute between collectives (~10 ms here, a block's matmul on a CPU) drift
            # apart and wait for each other at every one: the latency a training step sees
            for _ in range(5):
                for _ in range(4 if device == "cpu" else 400):
                    torch.mm(work, work)
                if collective:
                    dist.all_reduce(tiny)

        estimates = []
        for _ in range(3):  # noise (other processes) only adds time: the smallest estimate is the truest
            dist.barrier()
            with_sync = _timed(lambda: busy(True), seconds, sync, runs_wanted=5)
            dist.barrier()
            alone = _timed(lambda: busy(False), seconds, sync, runs_wanted=5)
            estimates.append((with_sync - alone) / 5)
        figures["latency"] = max(_timed(lambda: dist.all_reduce(tiny), seconds, sync, runs_wanted=50), min(estimates))
    return figures


# Two small Llamas whose measured steps fix the matmul efficiency and the per-operator cost.
REFERENCES = (
    dict(dim=256, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=1024, ffn_dim=704, max_seq_len=256,
         rope_theta=10000.0, rope_scaling=None),
    dict(dim=512, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=1024, ffn_dim=1408, max_seq_len=512,
         rope_theta=10000.0, rope_scaling=None),
)
REFERENCE_BATCH = 2


def _sharded_op_overhead(device: str, seconds: float) -> float:
    """Extra seconds an operator on DTensors costs over the same operator on plain tensors (the
    sharding propagation and dispatch tensor parallelism adds to every op of a block)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    plain = torch.randn(8, 8, device=device)
    sharded = distribute_tensor(plain, mesh, [Replicate()])  # a replicated add needs no communication
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def ops(x):
        for _ in range(20):
            x = x + x
        return x

    dist.barrier()
    return max(0.0, (_timed(lambda: ops(sharded), seconds, sync) - _timed(lambda: ops(plain), seconds, sync)) / 20)


def _reference_step(reference: dict, device: str, seconds: float) -> float:
    """Seconds of one fp32 training step (forward, backward, AdamW) of a small Llama on this rank
    alone, every rank at once."""
    import torch.distributed as dist

    from dtmega.models import Llama, LlamaConfig
    from dtmega.train.optim import adamw

    torch.manual_seed(0)
    config = LlamaConfig(**reference)
    model = Llama(config).to(device)
    optimizer = adamw(model, lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    tokens = torch.randint(0, config.vocab_size, (REFERENCE_BATCH, config.max_seq_len + 1), device=device)

    def step():
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    dist.barrier()
    return _timed(step, max(seconds, 1.0), sync=torch.cuda.synchronize if device == "cuda" else (lambda: None))


def fit_step_costs(hardware: Hardware, measured: list[float]) -> Hardware:
    """The matmul efficiency and seconds per operator that make the cost model's step times of
    the two reference steps equal the measured ones (what FLOPs at the peak rate and bytes at
    the bandwidth do not explain: small GEMMs, dispatch, autograd). Two equations, two unknowns:
    t_i = flops_i / (peak x efficiency) + ops_i x op_overhead + rest_i."""
    import dataclasses

    from dtmega.cost.estimate import estimate
    from dtmega.cost.shapes import ModelShape, PlanShape
    from dtmega.cost.step_time import OPS_PER_BLOCK
    from dtmega.models import LlamaConfig

    rows = []
    for reference, seconds in zip(REFERENCES, measured):
        config = LlamaConfig(**reference)
        plan = PlanShape(micro_batch=REFERENCE_BATCH, fused_optimizer=hardware.fused_optimizer)
        bare = estimate(ModelShape.of(config), plan, config.max_seq_len,
                        dataclasses.replace(hardware, op_overhead=0.0, efficiency=1.0))
        compute = bare.time.compute
        rows.append((compute, OPS_PER_BLOCK[False] * config.n_layers, seconds - (bare.step_s - compute)))
    (a1, b1, c1), (a2, b2, c2) = rows
    det = a1 * b2 - a2 * b1
    inverse_efficiency = (c1 * b2 - c2 * b1) / det if det else 1.0
    overhead = (a1 * c2 - a2 * c1) / det if det else 0.0
    efficiency = min(1.0, max(0.05, 1.0 / inverse_efficiency if inverse_efficiency > 0 else 1.0))
    if overhead <= 0:  # the fit says nothing about operators: put the rest into efficiency alone
        overhead = 1e-7
    return dataclasses.replace(hardware, efficiency=efficiency, op_overhead=overhead)


def _worker(rank: int, world: int, port: int, device: str, seconds: float, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world) if device == "cpu" else torch.get_num_threads())
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, measure_rank(device, seconds)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def calibrate(ranks: int, device: str, seconds: float, name: str | None = None) -> Hardware:
    """Measures with `ranks` local processes and returns the description (the slowest rank's figures)."""
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = mp.start_processes(_worker, args=(ranks, port, device, seconds, queue), nprocs=ranks,
                                   start_method="spawn", join=False)
    import queue as queues

    results = []
    while len(results) < ranks:  # drain before joining: a child exits only once its queue is flushed
        try:
            results.append(queue.get(timeout=1)[1])
        except queues.Empty:
            processes.join(timeout=0)  # raises, with the child's traceback, if a rank failed
    while not processes.join():
        pass
    slow_keys = ("op_overhead", "latency", "sharded_op_overhead", *(f"reference_step_{i}" for i in range(len(REFERENCES))))
    slowest = {key: min(r[key] for r in results) for key in results[0] if key not in slow_keys}
    slowest.update({key: max(r[key] for r in results) for key in slow_keys if key in results[0]})
    if device == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory
        label = name or torch.cuda.get_device_name(0)
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks
        label = name or f"cpu x{ranks} ranks"
    peak = {"float32": slowest["flops_float32"], "bfloat16": slowest["flops_bfloat16"],
            "float16": slowest["flops_bfloat16"]}
    bandwidth = slowest.get("bus_bandwidth", 0.0)
    latency = slowest.get("latency", 0.0)
    hardware = Hardware(label, float(memory), peak, slowest["memory_bandwidth"], bandwidth, bandwidth, latency, latency,
                        efficiency=1.0, op_overhead=slowest["op_overhead"], gpus_per_node=ranks,
                        fused_optimizer=device == "cuda",
                        host_memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8 / ranks,
                        sharded_op_overhead=slowest["sharded_op_overhead"] if device == "cpu" else 0.0,
                        # communication runs beside compute only where cores are left for it
                        overlap=device == "cuda" or (os.cpu_count() or 1) >= 2 * ranks,
                        oversubscription=1.0 if device == "cuda" else max(1.0, ranks / (os.cpu_count() or 1)),
                        host_bandwidth=slowest["memory_bandwidth"] if device == "cpu" else 25e9,
                        source=f"dtmega calibrate --ranks {ranks} --device {device}")
    return fit_step_costs(hardware, [slowest[f"reference_step_{i}"] for i in range(len(REFERENCES))])


def main(argv: list[str] | None = None) -> None:
    """`dtmega calibrate`."""
    from dtmega.printing import console

    args = build_parser().parse_args(argv)
    if args.ranks < 1:
        raise CalibrationError(f"--ranks must be >= 1, got {args.ranks}")
    if args.out.exists():
        raise CalibrationError(f"--out {args.out} exists; calibrate never overwrites. Fix: another path, or remove it")
    if args.device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < args.ranks):
        raise CalibrationError(f"--device cuda --ranks {args.ranks}: this machine has "
                               f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPUs")
    if not args.out.parent.is_dir():
        raise CalibrationError(f"--out {args.out}: the directory {args.out.parent} does not exist")
    hardware = calibrate(args.ranks, args.device, args.seconds, args.name)
    partial = args.out.with_name(args.out.name + ".partial")
    hardware.to_toml(partial)
    partial.rename(args.out)
    out = console()
    out.print(f"matmul fp32 {hardware.peak_flops['float32'] / 1e9:.1f} GFLOP/s, bf16 "
              f"{hardware.peak_flops['bfloat16'] / 1e9:.1f} GFLOP/s per rank; memory "
              f"{hardware.memory_bandwidth / 1e9:.1f} GB/s; all-reduce bus {hardware.intra_node_bandwidth / 1e9:.2f} GB/s, "
              f"latency {hardware.intra_node_latency * 1e6:.0f} us; matmul efficiency in a step "
              f"{hardware.efficiency:.2f}, operator {hardware.op_overhead * 1e6:.1f} us "
              f"(+{hardware.sharded_op_overhead * 1e6:.0f} "
              "us on DTensors) "
              f"({args.ranks} ranks at once)", highlight=False)
    out.print(f"wrote {args.out}", highlight=False)
