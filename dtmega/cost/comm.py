"""Bytes every collective moves per training step, per mesh axis, in closed form.

`tensor_bytes` is what the ranks hand to the collective (the size CommDebugMode and a profiler
see: an all-gather's output, a reduce-scatter's input, an all-reduce's buffer, a point-to-point
payload); `wire_bytes` is what each rank sends over the link by a ring algorithm ((n-1)/n of an
all-gather's output or a reduce-scatter's input, 2(n-1)/n of an all-reduce) and is what the
step-time estimate divides by bandwidth. docs/planning.md lists each formula.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtmega.cost.frameworks import framework_named
from dtmega.cost.memory import recomputed_blocks
from dtmega.cost.shapes import DTYPE_BYTES, ModelShape, PlanShape

WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1.0}


@dataclass(frozen=True)
class Collective:
    """One kind of collective on one axis, summed over a step on one rank."""

    axis: str
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | send
    count: float
    tensor_bytes: float
    size: int  # ranks taking part
    overlapped: bool  # runs under compute (FSDP prefetch, DDP buckets, the CP ring)

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends over the link (ring algorithms)."""
        return self.tensor_bytes * WIRE[self.kind](self.size)


def collectives(model: ModelShape, plan: PlanShape, seq: int) -> list[Collective]:
    """Every collective of one training step on the busiest rank (blocks of the first pipeline
    rank, the embedding and the output layer counted where they live)."""
    e = DTYPE_BYTES[plan.dtype]
    h = model.dim
    mbs = plan.microbatches
    layers = plan.layers_per_rank(model)
    tokens = plan.micro_batch * seq / plan.cp  # per micro-batch on this rank
    act = tokens * h * e
    out: list[Collective] = []
    forwards = 2 if plan.recompute == "full" else 1  # full recompute runs each block's forward twice
    if plan.tp > 1 and framework_named(plan.framework).tp_collectives == "megatron":
        out += _megatron_tensor_parallel(model, plan, tokens, layers)
    elif plan.tp > 1:
        # Per block and micro-batch (counted on CPU/gloo with CommDebugMode, docs/planning.md):
        # forward, the attention's and the MLP's outputs (2); backward, the input gradient of each
        # column-parallel linear (wq, wk, wv, w1, w3: 5, as DTensor reduces each consumer's
        # partial gradient). Per micro-batch: the embedding's output and the output layer's input
        # gradient; the vocab-parallel loss's max, sum and target logit (fp32, one per token).
        blocks = layers * mbs
        stats = Collective("tp", "all_reduce", 3 * mbs, 3 * mbs * tokens * 4, plan.tp, False)
        if plan.sp:
            # reduce-scatter after attention and MLP (forward), all-gather before them and their
            # transposes; the 5 input gradients stay all-reduces; the norms' weight gradients
            # (partial over the sequence shards) are all-reduced once per micro-batch
            # full recompute runs a block's forward again up to its last saved tensor: both
            # all-gathers and the attention's reduce-scatter, not the MLP's
            again = 1 if plan.recompute == "full" else 0
            gathers = blocks * (2 + 2 * again + 2) + 2 * mbs
            scatters = blocks * (2 + again) + 2 * mbs
            norms = (2 * layers + 1) * mbs
            out += [Collective("tp", "all_gather", gathers, gathers * act, plan.tp, False),
                    Collective("tp", "reduce_scatter", scatters, scatters * act, plan.tp, False),
                    Collective("tp", "all_reduce", 5 * blocks + norms + 3 * mbs,
                               5 * blocks * act + norms * h * 4 + 3 * mbs * tokens * 4, plan.tp, False)]
        else:
            count = blocks * (2 + (1 if plan.recompute == "full" else 0) + 5) + 2 * mbs  # recompute: the attention's again
            out.append(Collective("tp", "all_reduce", count + stats.count, count * act + stats.tensor_bytes, plan.tp,
                                  False))
    if plan.cp > 1:
        kv_block = 2 * tokens * model.kv_dim / plan.tp * e  # this rank's keys and values
        per_layer = layers * mbs * forwards
        if plan.cp_method == "ring":  # K/V hop cp-1 times forward and again backward; dK/dV (fp32) go home in cp
            sends = per_layer * (plan.cp - 1) + layers * mbs * (2 * plan.cp - 1)
            sent = per_layer * (plan.cp - 1) * kv_block + layers * mbs * ((plan.cp - 1) * kv_block + plan.cp * kv_block * 4 / e)
            out.append(Collective("cp", "send", sends, sent, plan.cp, True))
        elif plan.cp_method == "all_gather":  # gather K/V, reduce-scatter dK/dV
            out += [Collective("cp", "all_gather", per_layer, per_layer * kv_block * plan.cp, plan.cp, False),
                    Collective("cp", "reduce_scatter", layers * mbs, layers * mbs * kv_block * plan.cp, plan.cp, False)]
        else:  # a2a: q, k, v to head shards and the output back, and the transposes in backward
            heads = model.heads // plan.tp
            kv_heads = model.kv_heads // plan.tp if (model.kv_heads // plan.tp) % plan.cp == 0 else heads
            qkvo = tokens * model.head_dim * (2 * heads + 2 * kv_heads) * e
            count = 4 * layers * mbs * (forwards + 1)
            out.append(Collective("cp", "all_to_all", count, layers * mbs * (forwards + 1) * qkvo, plan.cp, False))
    if plan.ep > 1 and model.experts:
        # the MTP blocks (MoE, on the last stage) route their tokens too
        moe_layers = layers * model.moe_layers / model.layers + model.mtp_layers
        rows = model.ranks_per_token(plan.ep) if plan.dispatcher == "flex" else model.top_k
        routed = tokens * rows * h * e
        # dispatch and combine forward, their transposes backward: an EP group's ranks send
        # `routed` each on average (uneven splits: the rows follow the router), and each
        # forward dispatch first exchanges the rows per expert (int64)
        count = 2 * moe_layers * mbs * (forwards + 1)
        sizes = moe_layers * mbs * forwards
        out.append(Collective("ep", "all_to_all", count + sizes, count * routed + sizes * model.experts * 8, plan.ep,
                              False))
    if plan.pp > 1:
        # per micro-batch, each of a rank's chunks sends its activations to the next stage and
        # gradients to the one before, except at the pipeline's ends: the busiest rank is a
        # middle one (2 per chunk), or with two ranks either (one fewer); the loss comes back
        # from the last stage (one fp32 all-reduce, and the MoE balancing loss's)
        # from the last stage (one fp32 all-reduce, and the MoE balancing loss's). Under SP a
        # stage's output is its sequence shard, and that is what is sent. Megatron overlaps the
        # interleaved schedule's sends with the next chunk's compute (overlap_p2p_comm).
        sends = mbs * (2 * plan.vp - (1 if plan.pp == 2 else 0))
        scalars = 2 if model.experts else 1
        payload = act / plan.tp if plan.sp else act
        payload *= 1 + model.mtp_layers  # MTP: the embeddings of the tokens ahead travel with the hidden states
        hidden = plan.vp > 1 and framework_named(plan.framework).tp_collectives == "megatron"
        out += [Collective("pp", "send", sends, sends * payload, 2, hidden),
                Collective("pp", "all_reduce", scalars, 4 * scalars, plan.pp, False)]
    out += _data_parallel(model, plan)
    return [c for c in out if c.count > 0]


def _megatron_tensor_parallel(model: ModelShape, plan: PlanShape, tokens: float, layers: int) -> list[Collective]:
    """Megatron-Core's sequence-parallel TP per block and micro-batch: forward all-gathers the
    attention's and the MLP's input and reduce-scatters their outputs; backward all-gathers the
    output gradients, reduce-scatters the input gradients and all-gathers the saved (sharded)
    inputs again for the weight gradients: 4 all-gathers and 2 reduce-scatters of [tokens, h]
    per block backward, 2 and 2 forward (a recomputed block's forward again). The inputs of FP8
    linears are gathered in FP8 (Transformer Engine casts before the gather). Without SP, the
    same regions all-reduce (2 forward, 2 backward)."""
    e = DTYPE_BYTES[plan.dtype]
    gathered = 1 if plan.fp8 else e
    act = tokens * model.dim
    blocks = layers * plan.microbatches
    again = recomputed_blocks(plan, layers) * plan.microbatches
    if not plan.sp:
        count = 4 * blocks + 2 * again
        return [Collective("tp", "all_reduce", count, count * act * e, plan.tp, False)]
    input_gathers = 2 * blocks + 2 * blocks + 2 * again  # forward, backward's weight gradients, recompute
    grad_gathers = 2 * blocks
    scatters = 2 * blocks + 2 * blocks + 2 * again
    return [Collective("tp", "all_gather", input_gathers + grad_gathers,
                       (input_gathers * gathered + grad_gathers * e) * act, plan.tp, False),
            Collective("tp", "reduce_scatter", scatters, scatters * act * e, plan.tp, False)]


def _data_parallel(model: ModelShape, plan: PlanShape) -> list[Collective]:
    """FSDP all-gathers (forward, and again in backward for resharded blocks) and the gradient
    reduce-scatter; DDP's all-reduce; HSDP's reduce-scatter inside a replica and all-reduce across.
    Under expert parallelism each MoE layer's experts are a unit of their own, on the data ranks
    that hold the same experts (`dp_expert`, data / ep of them); dense weights use every data rank."""
    from dtmega.cost.memory import params_per_rank

    if plan.dp * plan.cp == 1:
        return []
    e = DTYPE_BYTES[plan.dtype]
    dense, experts = params_per_rank(model, plan, first=True, last=plan.pp == 1)
    units = plan.layers_per_rank(model, 0)
    expert_units = units * model.moe_layers / model.layers if plan.ep > 1 and model.experts else 0
    if not expert_units:  # experts (if any) are part of their block's unit
        dense, experts = dense + experts, 0.0
    data = plan.dp * plan.cp
    # the step's loss and token count (fp32), and the MoE balancing loss
    scalars = Collective("dp", "all_reduce", 3 if model.experts else 2, 12 if model.experts else 8, data, False)
    if plan.dp_mode == "distributed-optimizer":
        # Megatron's distributed optimizer: each bucket's bf16 gradients reduce-scattered once per
        # step (overlapped with backward), the updated weights all-gathered (overlapped with the
        # next forward; in FP8 with --fp8-param-gather), over the data x context ranks
        e = DTYPE_BYTES[plan.dtype]
        held = dense + experts
        weight_bytes = 1 if plan.fp8_param_gather else e
        return [Collective("dp", "reduce_scatter", units + 1, e * held, data, True),
                Collective("dp", "all_gather", units + 1, weight_bytes * held, data, True), scalars]
    if plan.dp_mode == "ddp":  # one all-reduce of fp32 gradients per unit (each block and the root)
        return [Collective("dp", "all_reduce", units + 1, 4 * dense, data, True),
                Collective("dp_expert", "all_reduce", expert_units, 4 * experts, data // plan.ep, True), scalars]
    table = model.vocab * model.dim / plan.tp
    root = table + (table if plan.pp == 1 and not model.tied else 0) + (model.dim if plan.pp == 1 else 0)
    blocks = dense - root
    regathers = 0 if plan.pp > 1 else 1  # pipeline stages keep blocks unsharded between micro-batches
    mbs = 1 if plan.pp > 1 else plan.microbatches
    shard_ranks = plan.fsdp_ranks
    # each block and the root all-gather forward, the (resharded) blocks again backward; each
    # unit reduce-scatters its fp32 gradients once per step
    expert_ranks = max(1, shard_ranks // plan.ep)
    if plan.fp8_param_gather:  # FP8 all-gather of the weights (one byte), the norms' few bytes aside
        e = 1
    out = [Collective("dp_shard", "all_gather", mbs * (units * (1 + regathers) + 1), (dense + blocks * regathers) * e * mbs,
                      shard_ranks, True),
           Collective("dp_shard", "reduce_scatter", units + 1, 4 * dense, shard_ranks, True),
           Collective("dp_expert", "all_gather", mbs * expert_units * (1 + regathers), experts * e * mbs * (1 + regathers),
                      expert_ranks, True),
           Collective("dp_expert", "reduce_scatter", expert_units, 4 * experts, expert_ranks, True)]
    if plan.dp_mode == "hsdp":
        replicas = data // shard_ranks
        out += [Collective("dp_replicate", "all_reduce", units + 1, 4 * dense / shard_ranks, replicas, True),
                Collective("dp_replicate", "all_reduce", expert_units, 4 * experts / expert_ranks, replicas, True)]
    return [*out, scalars]
