"""The cost analysis of an annotated program: read the layout and the passes' results, touch
no tensor, and estimate memory, FLOPs, bytes and time for the busiest rank.

Runs inside `dtmega.check_plan(..., workload=...)` and `parallelize(..., workload=...)` (so under
`simulate_world` too); `layout.cost` and `pm.report()` carry the result.
"""

from __future__ import annotations

from dtmega.cost.estimate import CostEstimate, estimate
from dtmega.cost.hardware import Hardware
from dtmega.cost.shapes import ModelShape, PlanShape
from dtmega.kernels.errors import DtmegaError
from dtmega.passes.float8 import Float8Choice
from dtmega.passes.fuse_kernels import FusedLoss
from dtmega.passes.fused_ops import fused_op_of
from dtmega.passes.program import Program
from dtmega.passes.results import (
    Compilation,
    ContextSharding,
    DataParallelism,
    ExpertPlacement,
    PipelineStages,
    TensorParallelism,
)


def model_shape_of(program: Program) -> ModelShape:
    """The model's sizes from the family's facts (and, for experts, the layout's shapes)."""
    facts = program.facts
    experts = top_k = expert_ffn = moe_layers = shared = 0
    capacity = None
    if facts.moe is not None:
        moe = facts.moe
        experts, top_k, capacity = moe.num_experts, moe.top_k, moe.capacity_factor
        moe_layers = sum(1 for layer in moe.layers if layer.startswith("layers."))  # not an MTP module's block
        entry = program.layout[moe.experts_at(moe.layers[0])]
        numel = sum(_numel(p.shape) for p in entry.params.values())
        expert_ffn = numel // (len(entry.params) * experts * facts.dim)  # SwiGLU's three matrices, GeLU's two
        if moe.shared_experts:
            shared_fqn = f"{moe.layers[0]}.{moe.shared_experts}"
            shared = sum(_numel(p.shape) for fqn, m in program.layout.modules.items()
                         if fqn.startswith(shared_fqn) for p in m.params.values()) // (3 * facts.dim)
    return ModelShape(facts.dim, facts.n_layers, facts.n_heads, facts.n_kv_heads, facts.ffn_dim, facts.vocab_size,
                      facts.tied_embeddings, experts, top_k, expert_ffn, moe_layers, shared, capacity,
                      facts.latent_attention, facts.mtp_layers, facts.moe.num_groups if facts.moe else None,
                      facts.moe.group_topk if facts.moe else None,
                      head_width=0 if facts.head_dim * facts.n_heads == facts.dim else facts.head_dim,
                      gpt=facts.gpt_block)


def model_shape_of_spec(spec, config=None) -> ModelShape:
    """The sizes of a registered model (`ModelSpec`, its own config unless one is given), read
    from its family's facts on a meta-device build: any family the passes know, not only Llama
    configs (what `dtmega plan` and `--auto-plan` rank plans for)."""
    import torch

    with torch.device("meta"):
        model = spec.build(spec.config if config is None else config)
    program = Program.build(model, {})
    if program.family is None:
        raise DtmegaError(f"model {spec.name!r}: no model family knows {type(model).__name__}, so the cost model has "
                          "no shapes for it. Fix: register its family (dtmega.passes.register_family)")
    return model_shape_of(program)


def plan_shape_of(program: Program, hardware: Hardware | None = None) -> PlanShape:
    """The plan's sizes from the typed results the passes recorded and the layout's fields."""
    workload = program.workload
    tp = program.result(TensorParallelism)
    pipeline = program.result(PipelineStages)
    context = program.result(ContextSharding)
    data = program.result(DataParallelism)
    experts = program.result(ExpertPlacement)
    entries = list(program.layout.modules.values())
    policies = [entry.recompute for entry in entries if entry.recompute]
    recompute = "full" if "full" in policies else "selective" if policies else "none"
    precision = program.layout[""].precision
    float8 = program.result(Float8Choice)
    compute = precision.compute_dtype if precision is not None else None
    dtype = compute or (workload.dtype if workload else "float32")
    mesh = program.mesh_shape
    dp = program.data_size(context=False)
    mode = data.mode if data else "fsdp"
    shard = mesh.get(data.shard_axis, 1) * (experts.size if experts else 1) if data else 1
    microbatches = pipeline.microbatches if pipeline else (workload.microbatches if workload and
                                                            workload.microbatches else 1)
    return PlanShape(
        tp=tp.size if tp else 1, sp=any(entry.style == "sequence_norm" for entry in entries),
        pp=mesh.get(pipeline.axis, 1) if pipeline else 1, vp=pipeline.virtual_stages if pipeline else 1,
        schedule=pipeline.schedule if pipeline else "1f1b", cp=context.size if context else 1,
        cp_method=context.method if context else "ring", dp=dp, dp_mode=mode,
        dp_shard=shard if mode == "hsdp" else dp, ep=experts.size if experts else 1,
        micro_batch=workload.micro_batch if workload else 1, microbatches=microbatches, recompute=recompute,
        fused_kernels=any((op := fused_op_of(entry.kernel)) is not None and op.saves_activations for entry in entries),
        fused_loss=program.result(FusedLoss) is not None, compiled=program.result(Compilation) is not None,
        cpu_optimizer=precision is not None and precision.offload == "cpu", dtype=dtype,
        fused_optimizer=hardware.fused_optimizer if hardware else getattr(program.mesh, "device_type", "cpu") == "cuda",
        fp8=float8.recipe if float8 and float8.modules else None,
        fp8_param_gather=bool(float8 and float8.modules and float8.param_gather and mode != "ddp"),
    )


def analyze(program: Program, hardware: Hardware | None = None) -> CostEstimate | None:
    """The estimate for an annotated program with a workload (None without one: no step shapes)."""
    if program.workload is None or program.family is None:
        return None
    try:
        model = model_shape_of(program)
    except (KeyError, ZeroDivisionError, ValueError) as error:  # a family whose facts the formulas cannot read
        program.note(f"cost analysis skipped: the {program.family.name} family's shapes are not a Llama "
                     f"decoder's ({error})")
        return None
    return estimate(model, plan_shape_of(program, hardware), program.workload.seq_len, hardware)


def _numel(shape) -> int:
    out = 1
    for size in shape:
        out *= size
    return out
