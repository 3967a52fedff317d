"""A ranked plan as `dtmega train` options: flags on a command line, or a `--config` TOML."""

from __future__ import annotations

from typing import Any

from dtmega.cost.search import RunWorkload, pipeline_splits
from dtmega.cost.shapes import ModelShape, PlanShape

CP_COMM = {"ring": "p2p", "all_gather": "all_gather", "a2a": "a2a"}


def train_options(plan: PlanShape, model: ModelShape, work: RunWorkload) -> dict[str, Any]:
    """The TrainArgs fields (flag names with underscores) that run `plan`."""
    options: dict[str, Any] = {
        "tensor_model_parallel_size": plan.tp, "pipeline_model_parallel_size": plan.pp,
        "context_parallel_size": plan.cp, "micro_batch_size": plan.micro_batch,
        "global_batch_size": work.global_batch, "seq_length": work.seq,
    }
    if plan.sp:
        options["sequence_parallel"] = True
    if plan.vp > 1:
        options["num_layers_per_virtual_pipeline_stage"] = model.layers // (plan.pp * plan.vp)
    first_last = pipeline_splits(model.layers, plan.pp) if plan.pp > 1 else (0, 0)
    if first_last and first_last[0]:
        options["decoder_first_pipeline_num_layers"], options["decoder_last_pipeline_num_layers"] = first_last
    if plan.cp > 1:
        options["cp_comm_type"] = CP_COMM[plan.cp_method]
    options["data_parallel"] = plan.dp_mode
    if plan.dp_mode == "hsdp":
        options["data_parallel_shard_size"] = plan.dp_shard
    if plan.ep > 1:
        options["expert_model_parallel_size"] = plan.ep
        if plan.dispatcher == "flex":
            options["moe_token_dispatcher_type"] = "flex"
    if plan.recompute == "full":
        options.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif plan.recompute == "selective":
        options["recompute_granularity"] = "selective"
    if plan.cpu_optimizer:
        options["cpu_optimizer"] = True
    if plan.dtype == "bfloat16":
        options["bf16"] = True
    elif plan.dtype == "float16":
        options["fp16"] = True
    if plan.fp8:
        options.update(fp8_format="hybrid", fp8_recipe=plan.fp8)
        if plan.fp8_param_gather:
            options["fp8_param_gather"] = True
    if plan.document_length:
        options["reset_attention_mask"] = True
    if plan.fused_loss:
        options["cross_entropy_loss_fusion"] = True
    return options


def as_flags(options: dict[str, Any]) -> str:
    """'--tensor-model-parallel-size 8 --sequence-parallel ...'."""
    parts = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {value}")
    return " ".join(parts)
