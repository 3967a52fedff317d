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
from dtmega.cost.frameworks import Framework, framework_named
from dtmega.cost.hardware import Hardware
from dtmega.cost.memory import gib, memory
from dtmega.cost.shapes import ModelShape, PlanShape
from dtmega.kernels.errors import DtmegaError


@dataclass(frozen=True)
class RunWorkload:
    """What the run trains on: sequence length, sequences per step, compute dtype, the FP8
    scaling of the blocks' linears (None: no FP8), and for packed documents masked per document
    their mean length in tokens (None: attention spans the whole sequence)."""

    seq: int
    global_batch: int
    dtype: str = "bfloat16"
    fp8: str | None = None
    document_length: int | None = None


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


def virtual_stages(layers: int, pp: int, framework: Framework) -> list[tuple[int, bool]]:
    """(virtual stages per rank, embedding and loss counted in the split) a pipeline of `pp`
    ranks can take: every vp dividing the blocks per rank, and under Megatron-Core also those
    that divide blocks + 2 (--account-for-embedding/loss-in-pipeline-split)."""
    if pp == 1:
        return [(1, False)]
    out = [(1, False)] + [(v, False) for v in range(2, layers // pp + 1) if layers % (pp * v) == 0]
    if framework.saves == "transformer-engine":
        out += [(v, True) for v in range(1, (layers + 2) // pp + 1) if (layers + 2) % (pp * v) == 0
                and (layers + 2) // (pp * v) >= 2]
    return out


def candidates(model: ModelShape, gpus: int, gpus_per_node: int, work: RunWorkload, result: SearchResult,
               *, max_micro_batch: int = 16, allow_cpu_optimizer: bool = True, fused_optimizer: bool = True,
               framework: str = "dtmega"):
    """Every legal PlanShape (illegal ones are counted in `result` with their reason)."""
    kind = framework_named(framework)
    for tp in [d for d in divisors(gpus_per_node) if gpus % d == 0]:
        if any(value % tp for value in (model.heads, model.kv_heads, model.ffn)):
            result.reject("TP does not divide the heads, KV heads or MLP width", f"TP{tp}")
            continue
        overlaps = [o for o in kind.tp_overlaps if o != "none"] or ["none"] if tp > 1 else ["none"]
        for pp in divisors(gpus // tp):
            if pp > model.layers or pipeline_splits(model.layers, pp) is None:
                result.reject("PP cannot split the blocks", f"PP{pp} over {model.layers} blocks")
                continue
            for cp in divisors(gpus // (tp * pp)):
                if work.seq % (2 * cp):
                    result.reject("CP does not cut the sequence into 2·cp chunks", f"CP{cp}, seq {work.seq}")
                    continue
                dp = gpus // (tp * pp * cp)
                if work.global_batch % dp:
                    result.reject("DP does not divide the global batch", f"DP{dp}, batch {work.global_batch}")
                    continue
                methods = ["ring"] if cp == 1 or kind.saves == "transformer-engine" else \
                    ["ring", "all_gather"] + (["a2a"] if (model.heads // tp) % cp == 0 else [])
                for ep, dispatcher in _expert_choices(model, dp, kind):
                    for mode, shard in _data_modes(dp, cp, tp, ep, gpus_per_node, kind):
                        for mb in [m for m in (1, 2, 4, 8, 16, 32) if m <= max_micro_batch and
                                   (work.global_batch // dp) % m == 0]:
                            microbatches = work.global_batch // (dp * mb)
                            for vp, in_split in virtual_stages(model.layers, pp, kind):
                                if pp > 1 and microbatches < pp:
                                    result.reject("fewer micro-batches than pipeline stages", f"PP{pp} x{microbatches}")
                                    continue
                                if vp > 1 and microbatches % pp:
                                    result.reject("interleaved schedule needs micro-batches divisible by PP",
                                                  f"PP{pp}x{vp} with {microbatches}")
                                    continue
                                for method in methods:
                                    for recompute in ("none", "selective", "full"):
                                        offloads = (False, True) if allow_cpu_optimizer and mode in ("fsdp", "hsdp") \
                                            and kind.name == "dtmega" else (False,)
                                        for offload in offloads:
                                            for overlap in overlaps:
                                                yield PlanShape(
                                                    tp=tp, sp=tp > 1, pp=pp, vp=vp,
                                                    schedule="interleaved_1f1b" if vp > 1 else "1f1b",
                                                    cp=cp, cp_method=method, dp=dp, dp_mode=mode, dp_shard=shard,
                                                    ep=ep, dispatcher=dispatcher, micro_batch=mb,
                                                    microbatches=microbatches,
                                                    recompute=recompute, fused_kernels=True, fused_loss=True,
                                                    cpu_optimizer=offload, fused_optimizer=fused_optimizer,
                                                    dtype=work.dtype, framework=kind.name, tp_overlap=overlap,
                                                    fp8=work.fp8, fp8_param_gather=_fp8_gather(work.fp8, mode, dp * cp),
                                                    embedding_in_split=in_split,
                                                    document_length=work.document_length)


def _expert_choices(model: ModelShape, dp: int, kind) -> list[tuple[int, str]]:
    """(EP size, token dispatcher) pairs to try: every EP size that divides the data ranks and
    the experts, each with the all-to-all dispatcher and, for a model with group-limited
    routing in dtmega, the flex one too (a row per token and rank: fewer bytes where the groups
    put a token's experts on few ranks; without groups its saving is a few percent, not worth
    doubling the search); groups that do not map onto the EP ranks are not tried (refused at
    launch). `--compare dispatcher=flex` costs a flex plan of any MoE model."""
    sizes = [e for e in divisors(dp) if model.experts and model.experts % e == 0] or [1]
    out = []
    for ep in sizes:
        if ep > 1 and model.groups and model.groups > 1 and model.groups % ep and ep % model.groups:
            continue
        out.append((ep, "alltoall"))
        if ep > 1 and kind.name == "dtmega" and model.groups and model.groups > 1:
            out.append((ep, "flex"))
    return out


def _fp8_gather(fp8: str | None, mode: str, data: int) -> bool:
    """FP8 weights gathered in FP8 wherever weights are gathered at all (delayed or tensorwise
    scales: a row-wise scaled weight has no single scale to gather with)."""
    return bool(fp8) and fp8 != "rowwise" and data > 1 and mode != "ddp"


def _data_modes(dp: int, cp: int, tp: int, ep: int, gpus_per_node: int,
                framework: Framework) -> list[tuple[str, int]]:
    """(mode, ranks one replica shards over): DDP, FSDP over all, HSDP sharding within a node,
    Megatron's distributed optimizer and Megatron-FSDP, as the framework has them."""
    have = framework.data_parallel
    if dp * cp == 1:
        return [(have[0], 1)]
    modes = [(mode, dp) for mode in ("fsdp", "distributed-optimizer", "megatron-fsdp") if mode in have]
    if "ddp" in have:
        modes.insert(0, ("ddp", 1))
    in_node = gpus_per_node // (tp * cp) if gpus_per_node % (tp * cp) == 0 else 0
    if "hsdp" in have and 1 < in_node < dp and dp % in_node == 0 and in_node % ep == 0:
        modes.append(("hsdp", in_node))
    return modes


def search(model: ModelShape, gpus: int, gpus_per_node: int, work: RunWorkload, hardware: Hardware, *,
           headroom: float = 0.9, max_micro_batch: int = 16, allow_cpu_optimizer: bool = True,
           framework: str = "dtmega") -> SearchResult:
    """Every legal plan that fits `headroom` of the device memory, ranked by predicted tokens/s
    per GPU (ties: less memory first)."""
    result = SearchResult([])
    capacity = hardware.memory_bytes * headroom
    for plan in candidates(model, gpus, gpus_per_node, work, result, max_micro_batch=max_micro_batch,
                           allow_cpu_optimizer=allow_cpu_optimizer, fused_optimizer=hardware.fused_optimizer,
                           framework=framework):
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
    # ties (speeds in the same 0.1 % band, at any speed): less memory, then the simpler plan
    # (fewer parallel dimensions, no offload)
    result.ranked.sort(key=lambda c: (-math.floor(math.log(c.tokens_per_s_per_gpu) / math.log(1.001)),
                                      round(c.memory.peak / 2**30, 1), c.plan.cp, c.plan.pp, c.plan.tp, c.plan.ep,
                                      c.plan.cpu_optimizer, c.plan.recompute != "none"))
    return result


SPEC_KEYS = {"tp": int, "pp": int, "vp": int, "cp": int, "dp": int, "ep": int, "mb": int, "recompute": str,
             "recompute_layers": int, "mode": str, "cp_method": str, "overlap": str, "split": str, "dispatcher": str}


def parse_plan_spec(text: str) -> dict[str, object]:
    """'tp=4,pp=4,cp=1' (any of tp, pp, vp, cp, dp, ep, mb, recompute, recompute_layers, mode,
    cp_method, overlap, split=embedding-and-loss, dispatcher=alltoall|flex) -> constraints."""
    out: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in SPEC_KEYS:
            raise DtmegaError(f"--compare {text!r}: {item!r} is not key=value with a key of {sorted(SPEC_KEYS)}")
        try:
            out[key] = SPEC_KEYS[key](value)
        except ValueError:
            raise DtmegaError(f"--compare {text!r}: {key} must be {SPEC_KEYS[key].__name__}, got {value!r}") from None
    if out.get("split", "embedding-and-loss") != "embedding-and-loss":
        raise DtmegaError(f"--compare {text!r}: split takes one value, embedding-and-loss (Megatron's "
                          "--account-for-embedding/loss-in-pipeline-split)")
    return out


def _spec_view(plan: PlanShape) -> dict[str, object]:
    return {"tp": plan.tp, "pp": plan.pp, "vp": plan.vp, "cp": plan.cp, "dp": plan.dp, "ep": plan.ep,
            "mb": plan.micro_batch, "recompute": plan.recompute, "recompute_layers": plan.recompute_layers,
            "mode": plan.dp_mode, "cp_method": plan.cp_method, "overlap": plan.tp_overlap,
            "split": "embedding-and-loss" if plan.embedding_in_split else None, "dispatcher": plan.dispatcher}


def matches(plan: PlanShape, spec: dict[str, object]) -> bool:
    """Whether `plan` has every size the spec names."""
    view = _spec_view(plan)
    return all(view[key] == value for key, value in spec.items())


def plan_from_spec(spec: dict[str, object], model: ModelShape, gpus: int, work: RunWorkload, *,
                   framework: str = "dtmega", fused_optimizer: bool = True) -> PlanShape:
    """The one plan a fully named spec describes (what is not named takes the search's choice:
    SP with TP, FP8 weights gathered in FP8, the framework's first data-parallel mode and its TP
    overlap); DtmegaError when the sizes cannot make a plan for `gpus`."""
    kind = framework_named(framework)
    tp, pp, cp, ep, mb = (int(spec.get(key, 1)) for key in ("tp", "pp", "cp", "ep", "mb"))
    if gpus % (tp * pp * cp):
        raise DtmegaError(f"--compare: TP {tp} x PP {pp} x CP {cp} does not divide {gpus} GPUs")
    dp = gpus // (tp * pp * cp)
    if "dp" in spec and spec["dp"] != dp:
        raise DtmegaError(f"--compare: dp={spec['dp']} but {gpus} GPUs / (TP x PP x CP) is {dp}")
    if work.global_batch % (dp * mb):
        raise DtmegaError(f"--compare: the global batch {work.global_batch} is not a whole number of micro-batches "
                          f"of {mb} on each of {dp} data ranks")
    vp = int(spec.get("vp", 1))
    mode = str(spec.get("mode", kind.data_parallel[0] if dp * cp > 1 else kind.data_parallel[0]))
    overlap = str(spec.get("overlap", ([o for o in kind.tp_overlaps if o != "none"] or ["none"])[0] if tp > 1 else "none"))
    kind.check(mode, overlap)
    layers = spec.get("recompute_layers")
    return PlanShape(tp=tp, sp=tp > 1, pp=pp, vp=vp, schedule="interleaved_1f1b" if vp > 1 else "1f1b", cp=cp,
                     cp_method=str(spec.get("cp_method", "ring")), dp=dp, dp_mode=mode,
                     dp_shard=dp, ep=ep, dispatcher=str(spec.get("dispatcher", "alltoall")), micro_batch=mb,
                     microbatches=work.global_batch // (dp * mb),
                     recompute=str(spec.get("recompute", "full" if layers else "none")),
                     recompute_layers=int(layers) if layers else None, fused_kernels=True, fused_loss=True,
                     fused_optimizer=fused_optimizer, dtype=work.dtype, framework=kind.name, tp_overlap=overlap,
                     fp8=work.fp8, fp8_param_gather=_fp8_gather(work.fp8, mode, dp * cp),
                     embedding_in_split=spec.get("split") == "embedding-and-loss", document_length=work.document_length)
