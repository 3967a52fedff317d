"""Whose implementation a plan's cost describes: dtmega's own, Megatron-Core's or torchtitan's.

The same plan (TP 4, PP 8 x 5, DP 2, ...) costs different memory and time in different
implementations: what a block saves for backward (Transformer Engine keeps sequence-parallel
inputs sharded and FP8 inputs in FP8; DTensor keeps the gathered ones), how tensor parallelism
communicates (Megatron all-gathers and reduce-scatters once per region and overlaps it with the
GEMMs; DTensor all-reduces the input gradient of every column-parallel linear), how the
optimizer state is sharded (Megatron's distributed optimizer vs FSDP2), and how close each one's
kernels come to the hardware's rates. `dtmega plan --framework NAME` costs plans as NAME runs
them, which is how the planner is held against published runs of Megatron-Core and torchtitan
(benchmarks/published_runs.py, docs/planning.md); dtmega's own plans are costed as `dtmega`.

Each efficiency is a fraction of the hardware's measured rate (dtmega/cost/hardware.py: its
large-GEMM, FP8-GEMM and attention-kernel rates) that the framework's training step reaches.
They are not datasheet facts: each says what it was fitted on (`fitted_on`), and the validation
table shows every row that was not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtmega.kernels.errors import DtmegaError


@dataclass(frozen=True)
class Framework:
    """One implementation's memory and time behaviour, for the cost model."""

    name: str
    summary: str
    data_parallel: tuple[str, ...]  # the data-parallel modes it has (PlanShape.dp_mode)
    tp_overlaps: tuple[str, ...]  # none | async (torch's async TP, compiled) | userbuffers (Megatron)
    tp_collectives: str  # "dtensor": torch's SP (5 input-gradient all-reduces per block) | "megatron"
    saves: str  # what a block keeps for backward: "dtensor" (dtmega's counted formula) | "transformer-engine"
    # what selective recompute recomputes: "attention-core" (dtmega, Megatron) | "alternate-matmuls"
    # (torchtitan's per-op policy: every other matmul's output and everything between matmuls)
    selective: str = "attention-core"
    gemm: float = 1.0  # fraction of the hardware's bf16 GEMM rate its blocks' GEMMs reach
    fp8_gemm: float = 1.0  # the same for FP8 GEMMs with tensorwise or delayed scales
    rowwise_fp8_gemm: float = 1.0  # FP8 GEMMs with row-wise scales, relative to `fp8_gemm`
    attention: float = 1.0  # fraction of the hardware's attention-kernel rate
    # the attention rate under context parallelism, relative to `attention`, at CP 2; each
    # doubling of CP multiplies it again (more, smaller ring steps and their merges)
    ring_attention: float = 1.0
    elementwise: float = 3.0  # non-GEMM bytes moved per byte a block saves for backward (fused/compiled)
    eager_elementwise: float = 3.0  # the same without fusion or compilation
    tp_exposed: dict[str, float] = field(default_factory=lambda: {"none": 1.0})  # share of TP time not hidden
    step_overhead: float = 0.0  # seconds per step beyond the kernels (host, optimizer step, clipping)
    fitted_on: str = ""  # where the efficiencies come from

    def tp_exposed_share(self, overlap: str, tp: int) -> float:
        """The share of TP transfer time left on the critical path. Megatron's userbuffers
        overlap splits each all-gather / reduce-scatter into tp ring-exchange steps pipelined
        with the GEMM's chunks: all but one step hide, 1/tp stays exposed. Other kinds: the
        framework's measured share (`tp_exposed`)."""
        if overlap == "userbuffers":
            return 1.0 / tp
        return self.tp_exposed[overlap]

    def check(self, dp_mode: str, tp_overlap: str) -> None:
        """A data-parallel mode or TP overlap this framework does not have is an input error."""
        if dp_mode not in self.data_parallel:
            raise DtmegaError(f"framework {self.name!r} has no data-parallel mode {dp_mode!r}; it has "
                              f"{', '.join(self.data_parallel)}")
        if tp_overlap not in self.tp_overlaps:
            raise DtmegaError(f"framework {self.name!r} has no tensor-parallel overlap {tp_overlap!r}; it has "
                              f"{', '.join(self.tp_overlaps)}")


FRAMEWORKS: dict[str, Framework] = {}


def register_framework(framework: Framework) -> Framework:
    """Adds (or replaces) a framework the cost model can cost plans as."""
    FRAMEWORKS[framework.name] = framework
    return framework


def framework_named(name: str) -> Framework:
    """The registered framework `name`; DtmegaError naming the choices otherwise."""
    try:
        return FRAMEWORKS[name]
    except KeyError:
        raise DtmegaError(f"--framework {name!r} is unknown; choose one of {', '.join(FRAMEWORKS)}") from None


# The efficiencies below were fitted by `python benchmarks/published_runs.py --fit` on the rows of
# benchmarks/published_runs.toml marked `calibration` (4 of Megatron-Core's 19, 10 of torchtitan's
# 32); the other 37 rows are predictions (docs/planning.md). dtmega's were fitted on its own two
# measured H100 steps (bf16 and FP8 tensorwise; its FP8 delayed-scaling step is predicted within
# 3.4 %), at width 2048: GEMMs of wider models run closer to the hardware's rate than that.

register_framework(Framework(
    name="dtmega",
    summary="dtmega's own passes: DTensor TP/SP, FSDP2/HSDP/DDP, torch's pipeline schedules, its kernels",
    data_parallel=("fsdp", "hsdp", "ddp"), tp_overlaps=("none",), tp_collectives="dtensor", saves="dtensor",
    gemm=0.685, fp8_gemm=0.466, attention=0.554, ring_attention=0.838, elementwise=0.725, eager_elementwise=8.26,
    fitted_on="gemm and fp8_gemm on dtmega's measured H100 steps (docs/measured/h100-gpu_step-kernels.json and "
              "h100-gpu_step-fp8.json: Llama 1.50 B, bf16 and FP8 tensorwise, compiled blocks); attention, "
              "ring attention and elementwise traffic are torch's kernels, torchtitan's fit; CPU hardware files "
              "carry their own calibrated efficiency instead",
))


register_framework(Framework(
    name="megatron-core",
    summary="Megatron-Core with Transformer Engine (Megatron-LM, NeMo, Megatron-Bridge): SP regions, "
            "userbuffers TP overlap, the distributed optimizer or Megatron-FSDP, interleaved 1F1B",
    data_parallel=("distributed-optimizer", "megatron-fsdp"), tp_overlaps=("userbuffers", "none"),
    tp_collectives="megatron", saves="transformer-engine",
    gemm=0.803, fp8_gemm=0.607, attention=0.878, ring_attention=0.532, elementwise=1.93, eager_elementwise=1.93,
    fitted_on="Megatron-Bridge 25.09's 8B, 70B and 405B rows and NeMo 24.07's 8B CP2 row; its TP overlap's "
              "exposed share is not fitted (1/tp, Framework.tp_exposed_share). Every published Megatron-Core row "
              "is FP8, so its bf16 GEMM efficiency (the output layer, and bf16 plans) is not fitted either: "
              "torchtitan's, whose bf16 GEMMs are the same cuBLAS kernels at the same shapes",
))

register_framework(Framework(
    name="torchtitan",
    summary="torchtitan: FSDP2/HSDP, DTensor TP/SP (async TP when compiled), torch's pipeline schedules, "
            "torch.compile, torchao float8",
    data_parallel=("fsdp", "hsdp"), tp_overlaps=("async", "none"), tp_collectives="dtensor", saves="dtensor",
    selective="alternate-matmuls",
    gemm=0.803, fp8_gemm=0.667, rowwise_fp8_gemm=0.615, attention=0.554, ring_attention=0.838, elementwise=0.725,
    eager_elementwise=8.26, tp_exposed={"none": 1.0, "async": 0.662}, step_overhead=0.413,
    fitted_on="10 of its 32 published H100 rows (2024-12: 8B bf16 eager and compiled, FP8, FP8 at 32k, 64k CP2 "
              "and 128k CP4, 70B TP8 FP8 with and without async TP; 2025-06: 70B bf16 TP8 and row-wise FP8 TP8); "
              "step_overhead is the per-step time its distributed steps spend beyond the kernels (optimizer over "
              "DTensors, clipping, host): not seen on one GPU",
))
