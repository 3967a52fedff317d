"""Hardware descriptions the cost model reads: peak rates, bandwidths, latencies, memory.

Built in: H100, H200, A100, B200 (vendor datasheets, dense, no sparsity) and whatever
`dtmega calibrate` measured on this machine and wrote as a TOML file. `efficiency` is the
fraction of the datasheet matmul rate a training step's GEMMs reach (measured: dtmega's Llama
1.5 B step on one H100 at 48.5 % MFU, docs/planning.md); bandwidths are the per-GPU figures a
ring collective reaches (bus bandwidth), not the link's marketing number.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from dtmega.cost.datasheets import GPU_PEAK_TFLOPS
from dtmega.kernels.errors import DtmegaError
from dtmega.passes.toml_io import dump_toml, load_toml


class HardwareError(DtmegaError):
    """A hardware name or file that cannot be used; the message names the fix."""


@dataclass(frozen=True)
class Hardware:
    """One accelerator kind and its links. Rates in FLOP/s, bandwidths in bytes/s, latencies in
    seconds, memory in bytes."""

    name: str
    memory_bytes: float
    peak_flops: dict[str, float] = field(default_factory=dict)  # dtype name -> dense FLOP/s
    memory_bandwidth: float = 0.0  # HBM (or DRAM) bytes/s
    intra_node_bandwidth: float = 0.0  # per-GPU bus bandwidth of a ring inside a node
    inter_node_bandwidth: float = 0.0  # per-GPU bus bandwidth across nodes
    intra_node_latency: float = 5e-6
    inter_node_latency: float = 20e-6
    efficiency: float = 0.5  # fraction of peak a step's matmuls reach
    op_overhead: float = 0.0  # seconds of fixed cost per operator launch (the CPU's dispatch, GPU launches)
    # extra seconds per operator on DTensors (tensor-parallel blocks) where the host's dispatch is
    # on the critical path (CPUs); 0 on GPUs, whose host runs ahead of the kernels
    sharded_op_overhead: float = 0.0
    # ranks per core on an oversubscribed CPU (4 ranks on 2 cores: 2); a rank idle in a pipeline
    # bubble gives its core to a busy one: a bubble costs nothing once oversubscription >= pp
    oversubscription: float = 1.0
    overlap: bool = True  # communication overlaps compute (GPUs' copy engines; not CPUs with fewer cores than ranks)
    gpus_per_node: int = 8
    fused_optimizer: bool = True  # the trainer's AdamW is one fused kernel here (CUDA), no temporaries
    host_bandwidth: float = 25e9  # device <-> host bytes/s per device (PCIe), for --cpu-optimizer
    host_memory_bytes: float = 200e9  # host memory per device for --cpu-optimizer (a 2 TB node of 8, less the OS)
    source: str = "built in"

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in `dtype` (fp8 falls back to bf16 where not listed)."""
        for name in (dtype, "bfloat16" if dtype in ("float8", "float16") else dtype, "float32"):
            if name in self.peak_flops:
                return self.peak_flops[name]
        raise HardwareError(f"hardware {self.name!r} lists no matmul rate for {dtype}")

    def link(self, span_nodes: bool) -> tuple[float, float]:
        """(bandwidth, latency) of a collective whose ranks are in one node or span nodes."""
        if span_nodes:
            return self.inter_node_bandwidth, self.inter_node_latency
        return self.intra_node_bandwidth, self.intra_node_latency

    def to_toml(self, path: str | Path | None = None) -> str:
        """The description as TOML (what `dtmega calibrate` writes and `--gpu FILE` reads)."""
        return dump_toml(dataclasses.asdict(self), path)

    @classmethod
    def from_toml(cls, path: str | Path) -> "Hardware":
        """Reads a hardware file; every unknown or missing key is named."""
        data = load_toml(Path(path))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise HardwareError(f"{path}: unknown key(s) {unknown}; a hardware file has {sorted(known)}")
        for needed in ("name", "memory_bytes", "peak_flops"):
            if needed not in data:
                raise HardwareError(f"{path}: missing {needed!r} (write one with `dtmega calibrate --out {path}`)")
        data["peak_flops"] = {k: float(v) for k, v in data["peak_flops"].items()}
        return cls(**{**data, "source": str(path)})


_T, _G = 1e12, 1e9


def _datasheet(gpu: str, fp8: float | None = None) -> dict[str, float]:
    """Peak dense matmul FLOP/s by dtype from the trainer's datasheet table (one table for the
    planner and the trainer's MFU), with the FP8 rate where the GPU has one."""
    half, single = GPU_PEAK_TFLOPS[gpu]
    rates = {"bfloat16": half * _T, "float16": half * _T, "float32": single * _T}
    return {"float8": fp8 * _T, **rates} if fp8 else rates


BUILT_IN: dict[str, Hardware] = {
    # NVLink 4: 900 GB/s per GPU bidirectional, ~370 GB/s bus bandwidth measured by nccl-tests;
    # InfiniBand NDR 400 Gb/s per GPU: ~45 GB/s.
    "h100": Hardware("h100", 80e9, _datasheet("H100", 1979), 3.35e12, 370 * _G, 45 * _G, 5e-6, 20e-6, 0.55, 4e-6),
    "h200": Hardware("h200", 141e9, _datasheet("H200", 1979), 4.8e12, 370 * _G, 45 * _G, 5e-6, 20e-6, 0.55, 4e-6),
    "a100": Hardware("a100", 80e9, _datasheet("A100"), 2.0e12, 230 * _G, 22 * _G, 6e-6, 25e-6, 0.55, 5e-6),
    "b200": Hardware("b200", 180e9, _datasheet("B200", 4500), 8.0e12, 740 * _G, 90 * _G, 5e-6, 20e-6, 0.55, 4e-6),
}


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A built-in name (h100, h200, a100, b200) or a file from `dtmega calibrate`."""
    key = str(name_or_path).lower()
    if key in BUILT_IN:
        return BUILT_IN[key]
    path = Path(name_or_path)
    if path.is_file():
        return Hardware.from_toml(path)
    raise HardwareError(f"--gpu {name_or_path!r} is neither a built-in ({', '.join(BUILT_IN)}) nor a file. Fix: one "
                        "of those names, or measure this machine with `dtmega calibrate --out hw.toml` and pass hw.toml")
