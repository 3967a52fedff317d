"""Step time from FLOPs, bytes and a hardware description, with what overlaps what.

Two models, by what the hardware description knows:

With kernel rates (the built-in GPUs: `Hardware.attention_efficiency` set), per micro-batch on
the busiest pipeline rank, each kernel class at its own measured rate, scaled by the
framework's efficiency (dtmega/cost/frameworks.py):

    gemm       = 6 x tokens x block linear parameters / tp / GEMM rate (bf16, or FP8 for the
                 blocks' linears), + a recomputed block's forward
    attention  = 3.5 x the causal attention forward's FLOPs (flash attention's backward is 2.5
                 forwards) / attention rate; recompute adds a forward
    output     = the output layer's GEMMs at the bf16 rate, its loss's bytes
    memory     = non-GEMM bytes (norms, RoPE, SwiGLU, residuals: `elementwise` x the bytes a block
                 saves) and FP8 casts (each FP8 operand read, written in FP8, transposed, and read
                 once more for its amax with current scaling) / HBM bandwidth
    exposed    = the share of TP transfers not hidden under GEMMs (`tp_exposed` by overlap kind),
                 CP ring transfers beyond the attention they overlap, EP and PP transfers
    overlapped = data-parallel transfers beyond the step's compute, and the last bucket's
    bubble     = (pp - 1) / vp x one micro-batch's compute on a stage
    step       = micro-batches x (gemm + attention + memory + output) + exposed + bubble + optimizer

Without them (a CPU file from `dtmega calibrate`: one lumped rate measured on reference steps):

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
from dtmega.cost.frameworks import Framework, framework_named
from dtmega.cost.hardware import Hardware
from dtmega.cost.memory import activation_bytes_per_token, params_per_rank, recomputed_blocks
from dtmega.cost.shapes import DTYPE_BYTES, ModelShape, PlanShape

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
    # packed documents: attention (12 L h S per token) runs over each document only
    flops -= 12.0 * model.layers * model.dim * (seq - plan.attention_keys(seq)) * tokens
    block_share = 1 - 6.0 * model.vocab * model.dim / model.flops_per_token(seq)
    if plan.recompute == "full":
        flops += flops * block_share / 3  # one more forward of every block
    elif plan.recompute == "selective":
        flops += 4.0 * model.layers * model.dim * seq * tokens  # the attention core's forward again
    return flops / plan.world


def step_time(model: ModelShape, plan: PlanShape, seq: int, hardware: Hardware, comms: list[Collective]) -> StepTime:
    """The estimate for one step; see the module docstring for the two models."""
    if hardware.attention_efficiency is not None:
        return _kernel_step_time(model, plan, seq, hardware, comms, framework_named(plan.framework))
    return _lumped_step_time(model, plan, seq, hardware, comms)


def _lumped_step_time(model: ModelShape, plan: PlanShape, seq: int, hardware: Hardware,
                      comms: list[Collective]) -> StepTime:
    """One lumped FLOP rate for everything (CPU hardware files, and GPUs without kernel-level
    rates): the FP8 rate when the plan's linears run in FP8."""
    rate = hardware.flops("float8") if plan.fp8 and "float8" in hardware.peak_flops else hardware.flops(plan.dtype)
    compute = rank_flops(model, plan, seq) / (rate * hardware.efficiency)
    tokens = plan.micro_batch * seq / plan.cp * plan.microbatches
    layers = plan.layers_per_rank(model)
    traffic = 3 * tokens * layers * activation_bytes_per_token(model, plan, recompute="none", seq=seq)
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
    return StepTime(compute, memory, launches, exposed, bubble, _optimizer_time(model, plan, hardware))


def _optimizer_time(model: ModelShape, plan: PlanShape, hardware: Hardware) -> float:
    """Adam over this rank's share of the optimizer state."""
    dense, experts = params_per_rank(model, plan, first=True, last=plan.pp == 1)
    local = (dense + experts) / max(1, plan.optimizer_ranks)
    if plan.cpu_optimizer:  # gradients down and weights up over the host link, Adam in host memory
        return 32 * local / hardware.host_bandwidth
    # Adam reads weights, gradients and two states and writes three: ~3 x 16 bytes per parameter
    return 48 * local / hardware.memory_bandwidth if hardware.memory_bandwidth else 0.0


def block_linear_params(model: ModelShape) -> float:
    """Parameters of one block's matmuls that a token passes through (the routed experts' active
    share under MoE), from the model's FLOPs per token so MoE and dense count alike."""
    attention_part = 12.0 * model.layers * model.dim  # per token and unit of sequence length
    linear_flops = model.flops_per_token(1) - attention_part - 6.0 * model.vocab * model.dim
    return linear_flops / (6.0 * model.layers)


def fp8_cast_bytes_per_token(model: ModelShape, plan: PlanShape) -> float:
    """HBM bytes of one block's FP8 casts per token (fwd + bwd): each FP8 GEMM operand read in
    the compute dtype and written in FP8, its transpose for the weight gradient written and read,
    and with current scaling (tensorwise, rowwise) read once more for its amax."""
    if not plan.fp8:
        return 0.0
    e = DTYPE_BYTES[plan.dtype]
    h, q, kv, f = model.dim, model.q_dim, model.kv_dim, model.ffn
    forward = 2 * h + q + f  # the inputs of qkv, the output projection, w1/w3 and w2
    backward = q + 2 * kv + 2 * h + 2 * f  # the output gradients of the same linears
    per_element = e + 1 + (e if plan.fp8 != "delayed" else 0)
    return ((forward + backward) * per_element + forward * 2) / plan.tp


def _gemm_rate(hardware: Hardware, framework: Framework, fp8: str | None) -> float:
    if fp8:
        rate = hardware.flops("float8") * (hardware.fp8_efficiency or hardware.efficiency) * framework.fp8_gemm
        return rate * (framework.rowwise_fp8_gemm if fp8 == "rowwise" else 1.0)
    return hardware.flops("bfloat16") * hardware.efficiency * framework.gemm


def _kernel_step_time(model: ModelShape, plan: PlanShape, seq: int, hardware: Hardware, comms: list[Collective],
                      framework: Framework) -> StepTime:
    """Per kernel class at its own rate (see the module docstring)."""
    tokens = plan.micro_batch * seq / plan.cp  # per micro-batch on this rank
    layers = plan.layers_per_rank(model)
    recomputed = recomputed_blocks(plan, layers)
    again = recomputed / layers if layers else 0.0  # share of blocks whose forward runs twice
    bf16 = hardware.flops("bfloat16")
    gemm = 6 * tokens * block_linear_params(model) / plan.tp / _gemm_rate(hardware, framework, plan.fp8)
    alternate = plan.recompute == "selective" and framework.selective == "alternate-matmuls"
    gemm *= 1 + again / 3 + (1 / 6 if alternate else 0.0)  # a forward again; half the matmuls' forward
    attention_rate = bf16 * hardware.attention_efficiency * framework.attention
    if plan.cp > 1:
        attention_rate *= framework.ring_attention ** math.log2(plan.cp)
    attention_forward = 2 * tokens * plan.attention_keys(seq) * model.q_dim / plan.tp / attention_rate
    selective_again = 1.0 if plan.recompute == "selective" and framework.saves == "transformer-engine" else 0.0
    attention = attention_forward * (3.5 + again + selective_again)
    fused = plan.fused_kernels or plan.compiled
    traffic = (framework.elementwise if fused else framework.eager_elementwise) * \
        activation_bytes_per_token(model, plan, recompute="none", seq=seq) * (1 + (1.0 if alternate else again) / 3)
    traffic += fp8_cast_bytes_per_token(model, plan)
    memory = tokens * traffic / hardware.memory_bandwidth
    block = gemm + attention + memory
    output = 6 * tokens * model.vocab * model.dim / plan.tp / _gemm_rate(hardware, framework, None)
    output_memory = 12 * tokens * model.vocab / plan.tp / hardware.memory_bandwidth  # logits, softmax, gradient
    # the busiest stage: the last (output layer) unless the split gave it a block fewer for the loss
    relief = block if plan.embedding_in_split and plan.pp > 1 else 0.0
    last = max(0.0, output + output_memory - relief) / (output + output_memory)
    m = plan.microbatches
    compute_mb = layers * (gemm + attention) + last * output
    memory_mb = layers * memory + last * output_memory
    per_microbatch = compute_mb + memory_mb
    compute_total = m * (compute_mb + memory_mb)
    attention_total = m * layers * attention
    exposed, overlapped, ring = 0.0, 0.0, 0.0
    for c in comms:
        bandwidth, latency = hardware.link(_spans_nodes(c, plan, hardware))
        seconds = c.wire_bytes / bandwidth + c.count * latency if bandwidth else 0.0
        if c.axis == "tp":
            exposed += seconds * framework.tp_exposed_share(plan.tp_overlap, plan.tp)
        elif c.axis == "cp" and c.kind == "send":
            ring += seconds
        elif c.overlapped:
            overlapped += seconds
        else:
            exposed += seconds
    exposed += max(0.0, ring - attention_total)  # the ring's transfers hide under the attention they feed
    units = layers + 1
    exposed += max(0.0, overlapped - compute_total) + 2 * overlapped / units  # the first gather, the last reduce
    bubble = (plan.pp - 1) / plan.vp * per_microbatch if plan.pp > 1 else 0.0
    return StepTime(m * compute_mb, m * memory_mb, framework.step_overhead, exposed, bubble,
                    _optimizer_time(model, plan, hardware))


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
