"""The planner: every legal plan for a model, a GPU count and a workload, ranked by predicted
tokens per second per GPU, with the reason each rejected one was rejected.

Legal means what dtmega's passes accept: TP inside a node dividing the heads, KV heads, MLP
width and vocabulary; PP stages splitting the blocks (evenly, or Megatron's uneven first/last
stages), virtual stages for the interleaved schedule; CP dividing the sequence into 2·cp zigzag
chunks (a2a also the heads per TP rank); DP filling the rest and dividing the global batch; EP
dividing the data-parallel ranks and the experts. Sequence parallelism is always on with TP > 1
(the same bytes as TP's all-reduces, less memory).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from dtmega.cost.estimate import CostEstimate, estimate
from dtmega.cost.hardware import Hardware
from dtmega.cost.memory import gib, memory
from dtmega.cost.shapes import ModelShape, PlanShape
from dtmega.kernels.errors import DtmegaError


@dataclass(frozen=True)
class RunWorkload:
    """What the run trains on: sequence length, sequences per step, compute dtype."""

    seq: int
    global_batch: int
    dtype: str = "bfloat16"


@dataclass
class SearchResult:
    """Ranked plans (best first) and the count of rejected ones by reason, with an example each."""

    ranked: list[CostEstimate]
    rejected: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    considered: int = 0

    def reject(self, reason: str, example: str) -> None:
        self.rejected[reason] += 1
        self.examples.setdefault(reason, example)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_splits(layers: int, pp: int) -> tuple[int, int] | None:
    """(first, last) stage blocks for an uneven split (Megatron's
    --decoder-first/last-pipeline-num-layers), (0, 0) for an even one, None if impossible."""
    if layers % pp == 0:
        return 0, 0
    if pp < 3:
        return None
    per = math.ceil(layers / pp)
    ends = layers - (pp - 2) * per
    if ends < 2 or ends % 2:
        return None
    return ends // 2, ends // 2


def candidates(model: ModelShape, gpus: int, gpus_per_node: int, work: RunWorkload, result: SearchResult,
               *, max_micro_batch: int = 16, allow_cpu_optimizer: bool = True, fused_optimizer: bool = True):
    """Every legal PlanShape (illegal ones are counted in `result` with their reason)."""
    for tp in [d for d in divisors(gpus_per_node) if gpus % d == 0]:
        if any(value % tp for value in (model.heads, model.kv_heads, model.ffn)):
            result.reject("TP does not divide the heads, KV heads or MLP width", f"TP{tp}")
            continue
        for pp in divisors(gpus // tp):
            if pp > model.layers or pipeline_splits(model.layers, pp) is None:
                result.reject("PP cannot split the blocks", f"PP{pp} over {model.layers} blocks")
                continue
            vps = [1] + [v for v in (2, 4, 8) if pp > 1 and model.layers % (pp * v) == 0]
            for cp in divisors(gpus // (tp * pp)):
                if work.seq % (2 * cp):
                    result.reject("CP does not cut the sequence into 2·cp chunks", f"CP{cp}, seq {work.seq}")
                    continue
                dp = gpus // (tp * pp * cp)
                if work.global_batch % dp:
                    result.reject("DP does not divide the global batch", f"DP{dp}, batch {work.global_batch}")
                    continue
                methods = ["ring"] if cp == 1 else ["ring", "all_gather"] + (["a2a"] if (model.heads // tp) % cp == 0 else [])
                for ep in [e for e in divisors(dp) if model.experts and model.experts % e == 0] or [1]:
                    for mode, shard in _data_modes(dp, cp, tp, ep, gpus_per_node):
                        for mb in [m for m in (1, 2, 4, 8, 16, 32) if m <= max_micro_batch and
                                   (work.global_batch // dp) % m == 0]:
                            microbatches = work.global_batch // (dp * mb)
                            for vp in vps:
                                if pp > 1 and microbatches < pp:
                                    result.reject("fewer micro-batches than pipeline stages", f"PP{pp} x{microbatches}")
                                    continue
                                if vp > 1 and microbatches % pp:
                                    result.reject("interleaved schedule needs micro-batches divisible by PP",
                                                  f"PP{pp}x{vp} with {microbatches}")
                                    continue
                                for method in methods:
                                    for recompute in ("none", "selective", "full"):
                                        for offload in (False, True) if allow_cpu_optimizer and mode != "ddp" else (False,):
                                            yield PlanShape(
                                                tp=tp, sp=tp > 1, pp=pp, vp=vp,
                                                schedule="interleaved_1f1b" if vp > 1 else "1f1b",
                                                cp=cp, cp_method=method, dp=dp, dp_mode=mode, dp_shard=shard, ep=ep,
                                                micro_batch=mb, microbatches=microbatches, recompute=recompute,
                                                fused_kernels=True, fused_loss=True, cpu_optimizer=offload,
                                                fused_optimizer=fused_optimizer,
                                                dtype=work.dtype)


def _data_modes(dp: int, cp: int, tp: int, ep: int, gpus_per_node: int) -> list[tuple[str, int]]:
    """(mode, ranks one replica shards over): DDP, FSDP over all, HSDP sharding within a node."""
    if dp * cp == 1:
        return [("fsdp", 1)]
    modes = [("ddp", 1), ("fsdp", dp)]
    in_node = gpus_per_node // (tp * cp) if gpus_per_node % (tp * cp) == 0 else 0
    if 1 < in_node < dp and dp % in_node == 0 and in_node % ep == 0:
        modes.append(("hsdp", in_node))
    return modes


def search(model: ModelShape, gpus: int, gpus_per_node: int, work: RunWorkload, hardware: Hardware, *,
           headroom: float = 0.9, max_micro_batch: int = 16, allow_cpu_optimizer: bool = True) -> SearchResult:
    """Every legal plan that fits `headroom` of the device memory, ranked by predicted tokens/s
    per GPU (ties: less memory first)."""
    result = SearchResult([])
    capacity = hardware.memory_bytes * headroom
    for plan in candidates(model, gpus, gpus_per_node, work, result, max_micro_batch=max_micro_batch,
                           allow_cpu_optimizer=allow_cpu_optimizer, fused_optimizer=hardware.fused_optimizer):
        result.considered += 1
        need = memory(model, plan, work.seq)
        if need.host > hardware.host_memory_bytes:
            result.reject(f"--cpu-optimizer state does not fit {gib(hardware.host_memory_bytes):.0f} GiB of host memory "
                          "per GPU", f"{plan.describe()} needs {gib(need.host):.1f} GiB")
            continue
        if need.peak > capacity:
            result.reject(f"does not fit {gib(capacity):.0f} GiB ({headroom:.0%} of {hardware.name}'s memory)",
                          f"{plan.describe()} needs {gib(need.peak):.1f} GiB")
            continue
        result.ranked.append(estimate(model, plan, work.seq, hardware))
    # ties (to 0.1 %): less memory, then the simpler plan (fewer parallel dimensions, no offload)
    result.ranked.sort(key=lambda c: (-round(c.tokens_per_s_per_gpu, -1 if c.tokens_per_s_per_gpu > 1e4 else 0),
                                      round(c.memory.peak / 2**30, 1), c.plan.cp, c.plan.pp, c.plan.tp, c.plan.ep,
                                      c.plan.cpu_optimizer, c.plan.recompute != "none"))
    return result


def parse_plan_spec(text: str) -> dict[str, object]:
    """'tp=4,pp=4,cp=1' (any of tp, pp, vp, cp, dp, ep, mb, recompute, mode) -> constraints."""
    known = {"tp": int, "pp": int, "vp": int, "cp": int, "dp": int, "ep": int, "mb": int, "recompute": str,
             "mode": str, "cp_method": str}
    out: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise DtmegaError(f"--compare {text!r}: {item!r} is not key=value with a key of {sorted(known)}")
        try:
            out[key] = known[key](value)
        except ValueError:
            raise DtmegaError(f"--compare {text!r}: {key} must be {known[key].__name__}, got {value!r}") from None
    return out


def matches(plan: PlanShape, spec: dict[str, object]) -> bool:
    """Whether `plan` has every size the spec names."""
    names = {"tp": plan.tp, "pp": plan.pp, "vp": plan.vp, "cp": plan.cp, "dp": plan.dp, "ep": plan.ep,
             "mb": plan.micro_batch, "recompute": plan.recompute, "mode": plan.dp_mode, "cp_method": plan.cp_method}
    return all(names[key] == value for key, value in spec.items())
