"""`dtmega train --auto-plan`: the cost model chooses the parallel plan for this world size."""

from __future__ import annotations

import dataclasses
import os

from dtmega.train.args import ArgumentError, TrainArgs

# Options --auto-plan decides; giving one too would be silently overridden, so it is refused.
CHOSEN = {
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
    "expert_model_parallel_size": 1, "sequence_parallel": False, "micro_batch_size": None, "microbatches": None,
    "data_parallel": None, "data_parallel_shard_size": None, "recompute_granularity": None, "recompute_method": None,
    "recompute_num_layers": None, "cpu_optimizer": False, "num_layers_per_virtual_pipeline_stage": None,
    "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
    "use_distributed_optimizer": False,
}


def hardware_for(args: TrainArgs):
    """--hardware, else the built-in description of the GPU this process sees."""
    import torch

    from dtmega.cost.hardware import BUILT_IN, load_hardware

    if args.hardware:
        return load_hardware(args.hardware)
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        for key in BUILT_IN:
            if key in name:
                return BUILT_IN[key]
        raise ArgumentError(f"--auto-plan: no built-in description of {torch.cuda.get_device_name()!r}. Fix: "
                            "`dtmega calibrate --ranks <GPUs per node> --out hw.toml` and --hardware hw.toml")
    raise ArgumentError("--auto-plan on a CPU needs --hardware FILE: measure this machine with `dtmega calibrate "
                        "--ranks <ranks per node> --out hw.toml` (or name a GPU: h100, h200, a100, b200)")


def apply_auto_plan(args: TrainArgs, spec, config, world: int) -> tuple[TrainArgs, str]:
    """The arguments with the plan's options the cost model chose (the same on every rank: a pure
    function of the arguments, the model and the world size), and a note saying what was chosen
    and why. `spec` and `config`: the model (its shapes come from its family's facts)."""
    from dtmega.cost.analysis import model_shape_of_spec
    from dtmega.cost.plan_cli import PlanArgumentError, best_plan
    from dtmega.cost.plan_flags import train_options
    from dtmega.cost.search import RunWorkload

    given = [f"--{name.replace('_', '-')}" for name, default in CHOSEN.items() if getattr(args, name) != default]
    if given:
        raise ArgumentError(f"--auto-plan chooses {', '.join(given)} itself. Fix: drop them, or drop --auto-plan")
    if args.global_batch_size is None:
        raise ArgumentError("--auto-plan needs --global-batch-size (the plan splits it into micro-batches)")
    hardware = hardware_for(args)
    dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or min(world, hardware.gpus_per_node)
    model = model_shape_of_spec(spec, config)
    work = RunWorkload(args.seq_length, args.global_batch_size, dtype)
    try:
        best = best_plan(model, world, per_node, work, hardware)
    except PlanArgumentError as error:
        raise ArgumentError(str(error)) from None
    options = train_options(best.plan, model, work)
    chosen = {name: value for name, value in options.items()
              if name not in ("bf16", "fp16", "seq_length", "global_batch_size")}  # the run's own, taken as given
    args = dataclasses.replace(args, **chosen)
    return args, (f"--auto-plan on {world} x {hardware.name}: {best.plan.describe()}; predicted {best.memory.peak / 2**30:.2f} "
            f"GiB per rank, {best.step_s:.3f} s per step, MFU {best.mfu:.1%} (dtmega plan shows the ranking)")
