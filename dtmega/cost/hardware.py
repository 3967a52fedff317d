"""Hardware descriptions the cost model reads: peak rates, bandwidths, latencies, memory.

Built in: H100, H200, the 96 GB 500 W H100 of torchtitan's published runs, A100, B200 (vendor
datasheets, dense, no sparsity; the sources of every figure are listed above BUILT_IN) and
whatever `dtmega calibrate` measured on this machine and wrote as a TOML file. On the H100s and
the H200, `efficiency`, `fp8_efficiency` and `attention_efficiency` are the fractions of the peak
that large GEMMs, FP8 GEMMs and flash attention reach (measured kernel rates); A100, B200 and CPU
files keep one lumped efficiency for a whole step. Bandwidths are the per-GPU figures a ring
collective reaches (bus bandwidth), not the link's marketing number.
"""

from __future__ import annotations

import dataclasses
import math
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
    efficiency: float = 0.5  # fraction of the bf16 peak large matmuls reach (CPU files: a whole step's matmuls)
    fp8_efficiency: float | None = None  # fraction of the FP8 peak large FP8 matmuls reach (None: `efficiency`)
    # fraction of the bf16 peak a flash-attention kernel reaches, forward and backward, counting
    # the causal FLOPs it does; None (CPU files): attention is part of the one calibrated rate
    attention_efficiency: float | None = None
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
        return dump_toml({k: v for k, v in dataclasses.asdict(self).items() if v is not None}, path)

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
        if not isinstance(data["peak_flops"], dict):
            raise HardwareError(f"{path}: peak_flops must be a table of dtype = FLOP/s, got {data['peak_flops']!r}")
        rates = {f"peak_flops.{k}": v for k, v in data["peak_flops"].items()}
        positive = {name: data[name] for name in ("memory_bytes", "memory_bandwidth", "intra_node_bandwidth",
                                                  "inter_node_bandwidth", "efficiency", "fp8_efficiency",
                                                  "attention_efficiency", "oversubscription", "host_bandwidth",
                                                  "host_memory_bytes", "gpus_per_node") if data.get(name) is not None}
        at_least_zero = {name: data[name] for name in ("intra_node_latency", "inter_node_latency", "op_overhead",
                                                       "sharded_op_overhead") if data.get(name) is not None}
        optional_zero = ("memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth")  # 0: not measured
        for key, value in {**rates, **positive, **at_least_zero}.items():  # matrix 3, A9/A10
            number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            floor_ok = number and (value >= 0 if key in at_least_zero or key in optional_zero else value > 0)
            if not floor_ok:
                wanted = "0 or more" if key in at_least_zero or key in optional_zero else "above 0"
                raise HardwareError(f"{path}: {key} = {value!r} must be a finite number {wanted}. Fix: a measured "
                                    f"value (dtmega calibrate --out {path} writes one)")
        data["peak_flops"] = {k: float(v) for k, v in data["peak_flops"].items()}
        return cls(**{**data, "source": str(path)})


_T, _G = 1e12, 1e9


def _datasheet(gpu: str, fp8: float | None = None) -> dict[str, float]:
    """Peak dense matmul FLOP/s by dtype from the trainer's datasheet table (one table for the
    planner and the trainer's MFU), with the FP8 rate where the GPU has one."""
    half, single = GPU_PEAK_TFLOPS[gpu]
    rates = {"bfloat16": half * _T, "float16": half * _T, "float32": single * _T}
    return {"float8": fp8 * _T, **rates} if fp8 else rates


# Sources of the built-in figures (docs/planning.md, "Hardware files"):
# - peaks: NVIDIA's datasheets, dense (H100 SXM5 / H200 SXM: 989.4 TFLOP/s bf16, 1,978.9 fp8;
#   A100: 312; B200: 2,250 and 4,500), dtmega/cost/datasheets.py;
# - memory: what the device offers to allocations (torch's total_memory), not the marketing
#   figure: an "80 GB" H100 SXM 79.2 GiB (85.03e9 bytes), a "96 GB" H100 (HBM2e) 95.0 GiB
#   (torchtitan's log: 82.4 GiB is 86.73 % of it), an H200 139 GiB (what the device tool here
#   reports usable on one);
# - HBM bandwidth: datasheets (H100 SXM5 3.35 TB/s, H200 4.8, the 96 GB HBM2e part 2.4 as
#   torchtitan's benchmark page states);
# - bf16 GEMM efficiency 0.796: 787 TFLOP/s measured on this project's H100 for the fused loss's
#   GEMMs (docs/kernels.md); FP8 0.81: cuBLASLt 8192^3 e4m3 GEMMs at 1,599-1,630 TFLOP/s on sixteen
#   H100s (a public cross-check report: https://gitea.d-robotics.cc/han.zhao/test_gpu_scripts/raw/commit/
#   7ec2da18bc66f5199b97863ea8e4dea01dd801f0/reports_cublaslt_fp8_crosscheck_20260524.md);
# - attention 0.55: FlashAttention-3 / cuDNN on H100 at head dim 128, long causal sequences,
#   forward ~600-740 and backward ~450-550 TFLOP/s (the FlashAttention-3 paper, 2024): ~545
#   forward + backward, in causal FLOPs;
# - links: NVLink 4, 900 GB/s per GPU both ways; nccl-tests on 8 x H100 SXM reach 460-480 GB/s
#   bus bandwidth for all-reduce with NVLS and ~370 for ring all-gather / reduce-scatter, which
#   is what is used; InfiniBand NDR 400 Gb/s per GPU (50 GB/s), ~45 GB/s bus bandwidth;
# - the 500 W, 96 GB HBM2e H100 (Meta's Grand Teton hosts, where torchtitan's H100 numbers were
#   measured): the same datasheet peaks; sustained tensor-core clocks under a 500 W cap instead of
#   700 W are lower, by a factor no public GEMM benchmark states. Dynamic power goes as clock x
#   voltage^2 and voltage with clock along the DVFS curve, so clock ~ power^(1/3): (500/700)^(1/3)
#   = 0.894 of every kernel rate. (Left free, a fit of torchtitan's 32 rows put it at 0.888.)
_H100_LINKS = dict(intra_node_bandwidth=370 * _G, inter_node_bandwidth=45 * _G, intra_node_latency=5e-6,
                   inter_node_latency=20e-6, op_overhead=4e-6)
_H100_KERNELS = dict(efficiency=787 / 989.4, fp8_efficiency=1610 / 1978.9, attention_efficiency=0.55)
_POWER_CAP_500W = (500 / 700) ** (1 / 3)

BUILT_IN: dict[str, Hardware] = {
    "h100": Hardware("h100", 79.2 * 2**30, _datasheet("H100", 1979), 3.35e12, **_H100_LINKS, **_H100_KERNELS,
                     source="built in: H100 SXM5 80 GB (sources in dtmega/cost/hardware.py)"),
    "h200": Hardware("h200", 139 * 2**30, _datasheet("H200", 1979), 4.8e12, **_H100_LINKS, **_H100_KERNELS,
                     source="built in: H200 SXM 141 GB (the H100's chip and links, more and faster HBM)"),
    "h100-hbm2e-500w": Hardware(
        "h100-hbm2e-500w", 95.0 * 2**30, _datasheet("H100", 1979), 2.4e12, **_H100_LINKS,
        **{**_H100_KERNELS, "efficiency": _H100_KERNELS["efficiency"] * _POWER_CAP_500W,
           "fp8_efficiency": _H100_KERNELS["fp8_efficiency"] * _POWER_CAP_500W,
           "attention_efficiency": _H100_KERNELS["attention_efficiency"] * _POWER_CAP_500W},
        source="built in: H100 96 GB HBM2e at 500 W (Grand Teton; torchtitan's published H100 runs)"),
    "a100": Hardware("a100", 80 * 2**30, _datasheet("A100"), 2.0e12, 230 * _G, 22 * _G, 6e-6, 25e-6, 0.55, None, None,
                     5e-6),
    "b200": Hardware("b200", 180e9, _datasheet("B200", 4500), 8.0e12, 740 * _G, 90 * _G, 5e-6, 20e-6, 0.55, None, None,
                     4e-6),
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
