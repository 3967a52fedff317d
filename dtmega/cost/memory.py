"""Peak memory per rank: what each byte is for, from the model's shapes and the plan's sizes.

The formulas (docs/planning.md derives each one from what dtmega's Llama saves for backward,
checked against autograd's saved tensors in tests/unit/test_cost_model.py):

- weights, gradients: fp32 master copies, sharded over the FSDP ranks; Adam: two fp32 states;
  with `--cpu-optimizer` all three live on the host;
- gathered: FSDP's unsharded parameters in the compute dtype (the root and two blocks: the one
  running and the one prefetched; every block of a pipeline stage, which is never resharded
  between micro-batches), one block's unsharded fp32 gradients before its reduce-scatter; one
  data rank under autocast holds the 16-bit casts of every matmul weight through the step;
- activations, per token of a micro-batch per block (e bytes per element of the compute dtype,
  t = tp, s = sequence-parallel divisor): norms (h·e + 4)/s each (2·h·e + 4 unfused), the two
  gathered linear inputs 2·h·e, q, k, v and the attention output (2·qd + 2·kvd)·e/t plus the
  log-sum-exp 4·H/t, the MLP 3·f·e/t (4·f·e/t unfused); selective recompute drops the
  log-sum-exp, full recompute keeps h·e/s (the block input) plus one block's worth while it
  recomputes; micro-batches in flight per pipeline schedule;
- loss: the logits and their gradient (e + 4 + 4 + 4 bytes per token per vocabulary entry /tp,
  unfused), or one ~256 MiB chunk of the fused loss.

Other implementations (`PlanShape.framework`, dtmega/cost/frameworks.py) differ where they
really do: Transformer Engine keeps a sequence-parallel linear's input sharded (it gathers it
again in backward) and an FP8 linear's input in FP8; Megatron's distributed optimizer keeps the
weights (bf16, or FP8 with --fp8-param-gather) and bf16 gradients whole on every data rank and
shards only the fp32 master weights and Adam state; Megatron's --recompute-num-layers recomputes
only that many blocks of a stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from dtmega.cost.frameworks import framework_named
from dtmega.cost.shapes import DTYPE_BYTES, ModelShape, PlanShape

FUSED_LOSS_CHUNK_BYTES = 256 * 2**20  # FuseKernels' default chunk of fp32 logits


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one rank's device at its peak, by purpose (`host`: on the CPU, not counted)."""

    weights: float
    gradients: float
    optimizer: float
    optimizer_temps: float  # the optimizer step's temporaries (torch's foreach AdamW: two per parameter)
    gathered: float
    activations: float
    loss: float
    accumulating: bool = False  # gradients live through the forward (accumulation over micro-batches)
    host: float = 0.0

    @property
    def peak(self) -> float:
        """Peak device bytes: weights and optimizer state, plus the largest of the phases: the end
        of a forward (gathered weights, activations, the loss's logits; gradients already there when
        micro-batches accumulate), and the optimizer step (gradients and its temporaries)."""
        forward = self.gathered + self.activations + self.loss + (self.gradients if self.accumulating else 0.0)
        return self.weights + self.optimizer + max(forward, self.gradients + self.optimizer_temps)

    def rows(self) -> list[tuple[str, float]]:
        """(name, bytes) for a table."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if f.name != "accumulating"]


def params_per_rank(model: ModelShape, plan: PlanShape, *, first: bool, last: bool,
                    layers: int | None = None) -> tuple[float, float]:
    """(dense, expert) parameters a pipeline rank holds before FSDP sharding: its blocks' TP
    shards (`layers` of them; default: the first or last rank's), the embedding on the first
    rank and the output layer and final norm on the last."""
    if layers is None:
        layers = plan.layers_per_rank(model, 0 if first else plan.pp - 1)
    moe_fraction = model.moe_layers / model.layers
    moe_layers, dense_layers = layers * moe_fraction, layers * (1 - moe_fraction)
    attention = model.attention_params() / plan.tp + 2 * model.norm_params()
    dense = dense_layers * (attention + model.dense_mlp_params() / plan.tp)
    dense += moe_layers * (attention + model.dim * model.experts + 3 * model.dim * model.shared_ffn / plan.tp)
    experts = moe_layers * model.expert_params() / (plan.tp * plan.ep)
    table = model.vocab * model.dim / plan.tp
    if first:
        dense += table + model.position_params()
    if last:
        dense += (0 if (model.tied and first) else table) + model.norm_params()
        # multi-token prediction (DeepSeek): per depth an MoE block, two input norms and the output
        # norm, and the 2D -> D projection (whole on every TP rank)
        dense += model.mtp_layers * (attention + model.dim * model.experts + 3 * model.dim * model.shared_ffn / plan.tp
                                     + 3 * model.dim + 2 * model.dim * model.dim)
        experts += model.mtp_layers * model.expert_params() / (plan.tp * plan.ep)
    return dense, experts


def activation_bytes_per_token(model: ModelShape, plan: PlanShape, *, recompute: str | None = None,
                               seq: int = 0) -> float:
    """Bytes one block saves for backward per token of a micro-batch on this rank (`seq`: the
    sequence length, for attention dropout's per-key probabilities; 0 counts none)."""
    e = DTYPE_BYTES[plan.dtype]
    h, t = model.dim, plan.tp
    s = t if plan.sp else 1
    compact = plan.fused_kernels or plan.compiled  # fused (or compiler-fused) norms and SwiGLU
    policy = recompute or plan.recompute
    if policy == "full":
        return h * e / s
    framework = framework_named(plan.framework)
    if framework.saves == "transformer-engine":
        return _transformer_engine_bytes_per_token(model, plan, policy)
    if policy == "selective" and framework.selective == "alternate-matmuls":
        return _alternate_matmuls_bytes_per_token(model, plan)
    if model.gpt is not None:
        return _gpt_block_bytes_per_token(model, plan, policy, seq)
    norm = (h * e + 4) if compact else (2 * h * e + 4)
    attention = (2 * model.q_dim + 2 * model.kv_dim) * e / t
    if plan.cp > 1 and plan.cp_method == "all_gather":
        attention += 2 * model.kv_dim * e * (plan.cp - 1) / t  # the gathered keys and values of the whole sequence
    lse = 4 * model.heads / t
    moe_fraction = model.moe_layers / model.layers
    mlp = (3 if compact else 4) * model.ffn * e / t
    if model.experts:
        routed = model.top_k * (model.capacity_factor or 1.0)  # dropless: even routing on average
        # per routed copy of a token: its dispatched input, the expert's MLP, its output and the
        # weighted output; the router's scores and choices (fp32) per token
        expert_mlp = routed * (3 * h * e + (3 if compact else 4) * model.expert_ffn * e / t) + \
            8 * model.experts + 8 * model.top_k
        expert_mlp += (3 if compact else 4) * model.shared_ffn * e / t
        mlp = (1 - moe_fraction) * mlp + moe_fraction * expert_mlp
    saved = 2 * norm / s + 2 * h * e + attention + mlp
    return saved if policy == "selective" else saved + lse


def _gpt_block_bytes_per_token(model: ModelShape, plan: PlanShape, policy: str, seq: int) -> float:
    """What one of Megatron's GPT blocks (dtmega/models/gpt) saves per token, as autograd keeps it
    (tests/unit/test_cost_model.py): a LayerNorm its input and fp32 mean and 1/std (h·e + 8; an
    RMSNorm as the Llama's), the two linear inputs, the attention's q, k, v, output and
    log-sum-exp, a GeLU or squared-ReLU MLP its first output and its second's input (2·f·e/t;
    SwiGLU as the Llama's), the q/k norms their inputs and statistics, each hidden-dropout site
    its mask (h·e/s: two per block), and attention dropout the probabilities before and after
    dropping and the mask, per head and key (H·S·(2e + 1)/t: Korthikanti et al.'s 5as/h in 16
    bits), which selective recompute drops with the log-sum-exp."""
    g = model.gpt
    e = DTYPE_BYTES[plan.dtype]
    h, t = model.dim, plan.tp
    s = t if plan.sp else 1
    compact = plan.fused_kernels or plan.compiled
    layer_norm = g.normalization == "LayerNorm"
    norm = (h * e + 8) if layer_norm else (h * e + 4) if compact else (2 * h * e + 4)
    attention = (2 * model.q_dim + 2 * model.kv_dim) * e / t
    if g.qk_norm:  # each head's norm: its input (the projection's output, also saved) and statistics
        per_head = 8 if layer_norm else 4
        attention += (model.q_dim + model.kv_dim) * e / t + (model.heads + model.kv_heads) * per_head / t
    if plan.cp > 1 and plan.cp_method == "all_gather":
        attention += 2 * model.kv_dim * e * (plan.cp - 1) / t
    if g.activation == "swiglu":
        mlp = (3 if compact else 4) * model.ffn * e / t
    else:
        mlp = 2 * model.ffn * e / t
    if model.experts:
        routed = model.top_k * (model.capacity_factor or 1.0)
        per_expert = (3 if compact else 4) if model.expert_matrices == 3 else 2
        expert_mlp = routed * (3 * h * e + per_expert * model.expert_ffn * e / t) + 8 * model.experts + 8 * model.top_k
        fraction = model.moe_layers / model.layers
        mlp = (1 - fraction) * mlp + fraction * expert_mlp
    dropout = 2 * h * e / s if g.hidden_dropout > 0 else 0.0
    saved = 2 * norm / s + 2 * h * e + attention + mlp + dropout
    if policy == "selective":
        return saved
    probabilities = model.heads * seq / plan.cp * (2 * e + 1) / t if g.attention_dropout > 0 else 0.0
    return saved + 4 * model.heads / t + probabilities


def _transformer_engine_bytes_per_token(model: ModelShape, plan: PlanShape, policy: str) -> float:
    """What a Megatron-Core block with Transformer Engine saves per token: each LayerNormLinear
    its norm's input and its linear's input, sharded over sequence-parallel ranks (gathered again
    in backward) and in FP8 for an FP8 linear, and the norm's 1/rms; the attention kernel q, k, v,
    its output and log-sum-exp; the output projection's input (FP8 copy in FP8); the first MLP
    linear's output (for SwiGLU's backward) and the second's input."""
    e = DTYPE_BYTES[plan.dtype]
    fp8 = 1 if plan.fp8 else e
    h, t = model.dim, plan.tp
    s = t if plan.sp else 1
    norms = 2 * (h * e + h * fp8 + 4) / s
    attention = (2 * model.q_dim + 2 * model.kv_dim) * e / t + model.q_dim * fp8 / t
    lse = 4 * model.heads / t if policy != "selective" else 0.0
    mlp = 2 * model.ffn * e / t + model.ffn * fp8 / t
    return norms + attention + lse + mlp


def _alternate_matmuls_bytes_per_token(model: ModelShape, plan: PlanShape) -> float:
    """torchtitan's per-op selective recompute: the block's input, what the attention kernel
    saves (q, k, v, its output, log-sum-exp) and every other matmul's output (the rest of the
    seven, and everything between them, is recomputed in backward)."""
    e = DTYPE_BYTES[plan.dtype]
    h, t = model.dim, plan.tp
    s = t if plan.sp else 1
    attention = (2 * model.q_dim + 2 * model.kv_dim) * e / t + 4 * model.heads / t
    matmul_outputs = (model.q_dim + 2 * model.kv_dim + 2 * h + 2 * model.ffn) * e / t
    return h * e / s + attention + matmul_outputs / 2


def recomputed_blocks(plan: PlanShape, layers: int) -> int:
    """Blocks of a stage whose forward runs again in backward (full recompute)."""
    if plan.recompute != "full":
        return 0
    return layers if plan.recompute_layers is None else min(layers, plan.recompute_layers)


def in_flight(model: ModelShape, plan: PlanShape, pp_rank: int) -> float:
    """Micro-batches x blocks whose activations pipeline rank `pp_rank` holds at once."""
    layers = plan.layers_per_rank(model, pp_rank)
    m = plan.microbatches
    if plan.pp == 1:
        return layers
    if plan.schedule == "gpipe":
        return m * layers
    if plan.vp > 1:  # Megatron's interleaved warm-up: 2(pp - r - 1) + (vp - 1) pp chunks, then one more
        chunks = min(m * plan.vp, 2 * (plan.pp - pp_rank - 1) + (plan.vp - 1) * plan.pp + 1)
        return chunks * layers / plan.vp
    return min(m, plan.pp - pp_rank) * layers


def memory(model: ModelShape, plan: PlanShape, seq: int) -> MemoryBreakdown:
    """The busiest rank's peak: the first and the last pipeline rank are both estimated."""
    ranks = sorted({0, min(1, plan.pp - 1), plan.pp - 1})  # first, a middle one, last
    return max((_rank_memory(model, plan, seq, r) for r in ranks), key=lambda m: m.peak)


def _rank_memory(model: ModelShape, plan: PlanShape, seq: int, pp_rank: int) -> MemoryBreakdown:
    first, last = pp_rank == 0, pp_rank == plan.pp - 1
    e = DTYPE_BYTES[plan.dtype]
    layers = plan.layers_per_rank(model, pp_rank)
    dense, experts = params_per_rank(model, plan, first=first, last=last, layers=layers)
    shard = plan.fsdp_ranks
    expert_shard = max(1, shard // plan.ep) if shard > 1 else 1
    local = dense / shard + experts / expert_shard
    weights, gradients, optimizer = 4 * local, 4 * local, 8 * local
    if plan.dp_mode in ("distributed-optimizer", "megatron-fsdp"):
        # Megatron: the model's weights in the compute dtype (FP8 with --fp8-param-gather) and
        # its gradient buffer in bf16, sharded only under Megatron-FSDP; the optimizer's fp32
        # master weights and Adam's two states over the data x context ranks
        held = dense + experts
        if plan.dp_mode == "megatron-fsdp":
            held = local
        weight_bytes = 1 if plan.fp8_param_gather else e
        weights, gradients = weight_bytes * held, e * held
        optimizer = 12 * (dense + experts) / max(1, plan.optimizer_ranks)
    host = 0.0
    if plan.cpu_optimizer:
        host, weights, gradients, optimizer = weights + gradients + optimizer, 0.0, 0.0, 0.0
    block = (dense + experts - _table_params(model, plan, first, last)) / layers
    table = _table_params(model, plan, first, last)
    gathered = 0.0
    if plan.dp_mode == "distributed-optimizer":
        pass  # the weights are whole already; nothing is gathered
    elif plan.dp_mode == "megatron-fsdp" and shard > 1:
        gathered = (min(2, layers) * block + table) * (1 if plan.fp8_param_gather else e)
    elif plan.wrapped and shard > 1 or plan.cpu_optimizer:
        units = layers if plan.pp > 1 else min(2, layers)
        gathered = (units * block + table) * e + 4 * block  # + one unit's unsharded fp32 gradients
        if plan.pp > 1:
            gathered += 4 * (units - 1) * block  # unsharded gradients accumulate over micro-batches
    elif plan.wrapped and plan.dp_mode == "ddp":
        # DDP is FSDP2's replicate: its "unsharded" parameters are a second copy in the compute
        # dtype, kept from forward through backward; under a pipeline, the stage's fp32 gradients
        # accumulate unsharded over the micro-batches too
        gathered = (dense + experts) * (e + (4 if plan.pp > 1 else 0))
    elif not plan.wrapped and e < 4:
        gathered = (dense + experts - model.dim * 2 * layers) * e  # autocast's weight casts
    tokens = plan.micro_batch * seq / plan.cp
    recomputed = recomputed_blocks(plan, layers)
    whole = activation_bytes_per_token(model, plan, recompute="none", seq=seq)
    per_token = activation_bytes_per_token(model, plan, seq=seq)  # full recompute: the block's input only
    if 0 < recomputed < layers:  # only some blocks recompute: the others keep everything
        per_token = (recomputed * per_token + (layers - recomputed) * whole) / layers
    activations = in_flight(model, plan, pp_rank) * tokens * per_token
    if plan.recompute == "full":
        activations += tokens * whole
    if last and model.mtp_layers:  # the MTP blocks, their inputs ([embedding; hidden], projected) and logits
        vocab = model.vocab / plan.tp
        activations += model.mtp_layers * tokens * (whole + 5 * model.dim * e + vocab * (e + 4 + 4))
    # (the embedding's backward needs only the token ids: nothing for the first rank)
    loss = 0.0
    if last:
        vocab = model.vocab / plan.tp
        norm = model.dim * e + 4
        loss = tokens * (norm + model.dim * e)  # final norm and the output layer's input
        if plan.fused_loss and plan.framework == "dtmega":
            loss += 2 * min(FUSED_LOSS_CHUNK_BYTES, tokens * vocab * 4) + tokens * model.dim * 4
        elif plan.fused_loss:  # a fused vocab-parallel cross entropy: the logits and one fp32 buffer
            loss += tokens * vocab * (e + 4)
        else:
            loss += tokens * vocab * (e + (4 if e < 4 else 0) + 4 + 4)
    temps = 0.0 if plan.fused_optimizer else 8 * local
    if plan.cpu_optimizer:
        temps = 0.0  # on the host too
    return MemoryBreakdown(weights, gradients, optimizer, temps, gathered, activations, loss, plan.microbatches > 1, host)


def _table_params(model: ModelShape, plan: PlanShape, first: bool, last: bool) -> float:
    """Embedding and output parameters on this pipeline rank (TP shard, before FSDP)."""
    table = model.vocab * model.dim / plan.tp
    count = (table if first else 0) + ((0 if (model.tied and first) else table) + model.dim if last else 0)
    return count


def gib(value: float) -> float:
    """Bytes as GiB."""
    return value / 2**30


def fits(breakdown: MemoryBreakdown, capacity: float, headroom: float = 0.9) -> bool:
    """Whether the peak fits `capacity` with room for the allocator's fragmentation and the
    CUDA context (`headroom` of the device usable)."""
    return breakdown.peak <= capacity * headroom and not math.isnan(breakdown.peak)
