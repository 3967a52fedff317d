"""Step time from FLOPs, bytes and a hardware description, with what overlaps what.

    compute   = FLOPs on this rank / (peak rate x efficiency)      (recompute adds its forward)
    memory    = bytes of non-matmul traffic / memory bandwidth     (~3 x the saved activations)
    launches  = operators x op_overhead
    exposed   = TP, SP, CP (all-gather, a2a), EP and PP transfers  (on the critical path)
              + max(0, overlapped transfers - compute)             (FSDP prefetch, DDP buckets, CP ring)
    bubble    = (compute + memory + launches) x (pp - 1) / (microbatches x vp)
                x max(0, 1 - (oversubscription - 1) / (pp - 1))   (CPUs with more ranks than cores)
    step      = compute + memory + launches + exposed + bubble + optimizer
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtmega.cost.comm import Collective
from dtmega.cost.hardware import Hardware
from dtmega.cost.memory import activation_bytes_per_token, params_per_rank
from dtmega.cost.shapes import ModelShape, PlanShape

OPS_PER_BLOCK = {False: 90, True: 60}  # forward + backward operators of one block (unfused, fused)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on the busiest rank, by cause."""

    compute: float
    memory: float
    launches: float
    exposed_comm: float
    bubble: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.compute + self.memory + self.launches + self.exposed_comm + self.bubble + self.optimizer


def rank_flops(model: ModelShape, plan: PlanShape, seq: int) -> float:
    """FLOPs one rank runs per step, recompute included."""
    tokens = plan.micro_batch * plan.microbatches * seq * plan.dp  # global tokens per step (CP splits sequences)
    flops = model.flops_per_token(seq) * tokens
    block_share = 1 - 6.0 * model.vocab * model.dim / model.flops_per_token(seq)
    if plan.recompute == "full":
        flops += flops * block_share / 3  # one more forward of every block
    elif plan.recompute == "selective":
        flops += 4.0 * model.layers * model.dim * seq * tokens  # the attention core's forward again
    return flops / plan.world


def step_time(model: ModelShape, plan: PlanShape, seq: int, hardware: Hardware, comms: list[Collective]) -> StepTime:
    """The estimate for one step; see the module docstring for the model."""
    compute = rank_flops(model, plan, seq) / (hardware.flops(plan.dtype) * hardware.efficiency)
    tokens = plan.micro_batch * seq / plan.cp * plan.microbatches
    layers = plan.layers_per_rank(model)
    traffic = 3 * tokens * layers * activation_bytes_per_token(model, plan, recompute="none")
    memory = traffic / hardware.memory_bandwidth if hardware.memory_bandwidth else 0.0
    per_op = hardware.op_overhead + (hardware.sharded_op_overhead if plan.tp > 1 else 0.0)
    launches = OPS_PER_BLOCK[plan.fused_kernels or plan.compiled] * layers * plan.microbatches * per_op
    exposed, overlapped = 0.0, 0.0
    for c in comms:
        span = _spans_nodes(c, plan, hardware)
        bandwidth, latency = hardware.link(span)
        seconds = c.wire_bytes / bandwidth + c.count * latency if bandwidth else 0.0
        if c.overlapped and hardware.overlap:
            overlapped += seconds
        else:
            exposed += seconds
    exposed += max(0.0, overlapped - compute)
    bubble = 0.0
    if plan.pp > 1:
        bubble = (compute + memory + launches) * (plan.pp - 1) / (plan.microbatches * plan.vp)
        # ranks idle in the bubble give their cores to busy ones: with `oversubscription` ranks
        # per core and at least 1 in pp of them busy, no core idles once oversubscription >= pp
        bubble *= max(0.0, 1 - (hardware.oversubscription - 1) / (plan.pp - 1))
    dense, experts = params_per_rank(model, plan, first=True, last=plan.pp == 1)
    local = (dense + experts) / max(1, plan.fsdp_ranks)
    if plan.cpu_optimizer:  # gradients down and weights up over the host link, Adam in host memory
        optimizer = 32 * local / hardware.host_bandwidth
    else:  # Adam reads weights, gradients and two states and writes three: ~3 x 16 bytes per parameter
        optimizer = 48 * local / hardware.memory_bandwidth if hardware.memory_bandwidth else 0.0
    return StepTime(compute, memory, launches, exposed, bubble, optimizer)


def _spans_nodes(c: Collective, plan: PlanShape, hardware: Hardware) -> bool:
    """Whether an axis's ranks sit in more than one node: the mesh is laid out TP innermost,
    then CP, EP/data, PP outermost (as dtmega.make_mesh orders it)."""
    inner = {"tp": plan.tp, "cp": plan.tp * plan.cp, "ep": plan.tp * plan.cp * plan.ep,
             "dp_shard": plan.tp * plan.cp * plan.dp, "dp": plan.tp * plan.cp * plan.dp,
             "dp_expert": plan.tp * plan.cp * plan.dp,
             "dp_replicate": plan.tp * plan.cp * plan.dp, "pp": plan.world}
    reach = inner.get(c.axis, plan.world)
    if c.axis == "pp":
        return plan.world // plan.pp >= hardware.gpus_per_node  # neighbouring stages are a node apart
    return reach > hardware.gpus_per_node and not math.isinf(reach)
