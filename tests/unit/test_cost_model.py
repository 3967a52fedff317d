"""The cost model's formulas against what they describe: parameter bytes against the layout's
exact per-rank count, activation bytes against what autograd saves, a measured H100 run, and
the planner (`dtmega plan`, `--auto-plan`) against the passes that will run its choice."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import dtmega
from dtmega.cost.analysis import plan_shape_of
from dtmega.cost.hardware import BUILT_IN, Hardware, HardwareError, load_hardware
from dtmega.cost.memory import activation_bytes_per_token, memory, params_per_rank
from dtmega.cost.plan_cli import PlanArgumentError
from dtmega.cost.plan_cli import main as plan_main
from dtmega.cost.plan_flags import train_options
from dtmega.cost.search import RunWorkload, search
from dtmega.cost.shapes import ModelShape, PlanShape
from dtmega.models import Llama, LlamaConfig
from dtmega.models.moe_config import MoEConfig
from dtmega.passes import (
    ContextParallel,
    DataParallel,
    ExpertParallel,
    FuseKernels,
    PipelineSplit,
    Plan,
    Recompute,
    SequenceParallel,
    TensorParallel,
)
from dtmega.passes import Workload as StepWorkload


def _meta(config: LlamaConfig) -> nn.Module:
    with torch.device("meta"):
        return Llama(config)


@pytest.mark.parametrize("name, sizes, passes", [
    ("llama3-70b", dict(pp=4, dp_shard=4, tp=4), [TensorParallel(), SequenceParallel(),
                                                  PipelineSplit(microbatches=8), DataParallel("fsdp")]),
    ("llama3-8b", dict(dp_replicate=2, dp_shard=4, tp=2), [TensorParallel(), DataParallel("hsdp")]),
    ("llama3-405b", dict(pp=8, dp_shard=2, cp=2, tp=8), [TensorParallel(), SequenceParallel(), ContextParallel(),
                                                         PipelineSplit(microbatches=16, first_stage_layers=15,
                                                                       last_stage_layers=15), DataParallel("fsdp")]),
    ("mixtral-8x7b", dict(dp_shard=2, ep=4, tp=2), [TensorParallel(), ExpertParallel(), DataParallel("fsdp")]),
    # Megatron's GPT blocks (biases, LayerNorm, learned positions, a two-matrix GeLU MLP) with the
    # embedding tied across the pipeline's stages (the last stage holds a copy)
    ("gpt3-175b", dict(pp=8, dp_shard=2, tp=8), [TensorParallel(), SequenceParallel(), PipelineSplit(microbatches=16),
                                                 DataParallel("fsdp")]),
])
def test_parameter_bytes_per_rank_equal_the_layouts_count(name, sizes, passes):
    """The formulas' parameters per rank (first and last pipeline rank, after TP, PP, EP and
    FSDP) equal `Layout.local_param_count`, which counts what DTensor and FSDP2 allocate."""
    if name.startswith("gpt"):
        from dtmega.models.gpt import GPT, GPT_SIZES

        with torch.device("meta"):
            model = GPT(GPT_SIZES[name].replace(max_seq_len=2048))
    else:
        model = _meta(LlamaConfig.from_name(name))
    layout = dtmega.check_plan(model, sizes, passes, workload=StepWorkload(2048, 1, 16))
    cost = layout.cost
    plan = cost.plan
    pp = sizes.get("pp", 1)
    for pp_rank in {0, pp - 1}:
        dense, experts = params_per_rank(cost.model, plan, first=pp_rank == 0, last=pp_rank == pp - 1)
        expert_shard = max(1, plan.fsdp_ranks // plan.ep)
        predicted = dense / plan.fsdp_ranks + experts / expert_shard
        assert predicted == pytest.approx(layout.local_param_count({"pp": pp_rank}), rel=2e-3), pp_rank


def _block_saved_bytes(pm_or_model, tokens: torch.Tensor) -> int:
    """Bytes autograd saves inside block 0 (storages counted once; weights and buffers excluded)."""
    module = pm_or_model.module if hasattr(pm_or_model, "module") else pm_or_model
    block = module.get_submodule("layers.0")
    owned = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    inside, seen, total = [False], set(), [0]
    block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if inside[0] and storage.data_ptr() not in owned and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(tokens)
    return total[0]


@pytest.mark.parametrize("passes, policy, fused", [
    ([], "none", False), ([FuseKernels(cross_entropy=False)], "none", True),
    ([Recompute("selective")], "selective", False), ([Recompute("full")], "full", False),
], ids=["plain", "fused", "selective", "full"])
def test_activation_formula_equals_what_autograd_saves(passes, policy, fused):
    """Bytes per token per block of the memory model = the bytes autograd keeps for backward in
    a block of dtmega's Llama (fresh random weights and tokens; exact: the same tensors)."""
    config = LlamaConfig(dim=96, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=512, ffn_dim=160, max_seq_len=128,
                         rope_theta=10000.0, rope_scaling=None)
    torch.manual_seed(0)
    pm = dtmega.parallelize(Llama(config), dtmega.make_mesh(device_type="cpu"), Plan([*passes, DataParallel()]))
    tokens = torch.randint(0, 512, (2, 64))
    measured = _block_saved_bytes(pm, tokens)
    plan = PlanShape(micro_batch=2, recompute=policy, fused_kernels=fused)
    predicted = activation_bytes_per_token(ModelShape.of(config), plan) * tokens.numel()
    if policy == "full":
        # nothing is saved inside the block: the checkpoint keeps only its input, the previous
        # layer's output, which the formula counts as the block's h x 4 bytes per token
        assert measured == 0 and predicted == tokens.numel() * config.dim * 4
    else:
        assert predicted == measured


GPT_VARIANTS = {  # Megatron's GPT blocks: LayerNorm, biases, GeLU, learned positions, dropout 0.1 (gpt-debug)
    "gelu_no_dropout": dict(attention_dropout=0.0, hidden_dropout=0.0),
    "gelu_dropout": {},
    "squared_relu_qk_norm": dict(activation="squared_relu", qk_norm=True, attention_dropout=0.0),
    "rmsnorm_swiglu": dict(normalization="RMSNorm", activation="swiglu", bias=False, attention_dropout=0.0),
    "gelu_moe": dict(attention_dropout=0.0, moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=48, activation="gelu",
                                                          capacity_factor=1.0)),
}


@pytest.mark.parametrize("variant", list(GPT_VARIANTS))
@pytest.mark.parametrize("passes, policy, fused", [
    ([], "none", False), ([FuseKernels(cross_entropy=False)], "none", True), ([Recompute("selective")], "selective", False),
], ids=["plain", "fused", "selective"])
def test_gpt_block_activation_formula_equals_what_autograd_saves(variant, passes, policy, fused):
    """The GPT family's block (dtmega/models/gpt) in training mode, dropout on where the variant
    has it: the memory model's bytes per token per block = what autograd keeps in block 0 (exact,
    the same tensors); attention dropout's per-key probabilities need the sequence length."""
    from dtmega.cost.analysis import model_shape_of
    from dtmega.models.gpt import GPT, GPT_SIZES

    config = GPT_SIZES["gpt-debug"].replace(**GPT_VARIANTS[variant])
    torch.manual_seed(0)
    pm = dtmega.parallelize(GPT(config), dtmega.make_mesh(device_type="cpu"), Plan([*passes, DataParallel()]))
    pm.train()
    tokens = torch.randint(0, 200, (2, 32))
    measured = _block_saved_bytes(pm, tokens)
    shape = model_shape_of(pm.program)
    assert shape.total_params() == config.num_params()
    if config.moe:  # block 0 is an MoE block: the formula's MoE share is 1 for a model of MoE blocks only
        assert shape.moe_layers == shape.layers and shape.expert_ffn == 48
    plan = PlanShape(micro_batch=2, recompute=policy, fused_kernels=fused)
    predicted = activation_bytes_per_token(shape, plan, seq=tokens.shape[1]) * tokens.numel()
    assert predicted == pytest.approx(measured, rel=1e-9 if not config.moe else 0.05), (predicted, measured)


def test_the_measured_h100_run_is_predicted_within_10_percent():
    """benchmarks/gpu_step.py on one H100 (docs/measured/h100-gpu_step-kernels.json): Llama 1.50 B,
    seq 2048, micro-batch 8, bf16 autocast on one rank, compiled blocks; peak allocated 66.2 GiB
    with the unfused loss, 40.1 GiB with FuseKernels' fused loss."""
    measured = json.loads(Path("docs/measured/h100-gpu_step-kernels.json").read_text())["rows"]
    config = LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
                         max_seq_len=2048, tie_embeddings=False)
    for row, fused in (("dtmega", False), ("dtmega+kernels", True)):
        passes = [FuseKernels()] if fused else []
        from dtmega.passes import Compile

        layout = dtmega.check_plan(_meta(config), {}, [*passes, DataParallel("fsdp", param_dtype="bfloat16"),
                                                      Compile()], workload=StepWorkload(2048, 8), hardware="h100")
        predicted = layout.cost.memory.peak / 2**30
        assert predicted == pytest.approx(measured[row]["peak_gib"], rel=0.10), (row, predicted)
        assert layout.cost.step_s == pytest.approx(measured[row]["step_s"], rel=0.25), (row, layout.cost.step_s)


def test_chosen_plan_runs_as_the_passes_annotate_it():
    """The flags `dtmega plan` prints, parsed by `dtmega train` and annotated by the passes, give
    back the plan the search estimated (same sizes, same memory per rank)."""
    from dtmega.train.args import parse_train_args
    from dtmega.train.setup import build_plan, run_shape

    config = LlamaConfig.from_name("llama3-70b")
    model = ModelShape.of(config)
    work = RunWorkload(4096, 256)
    best = search(model, 64, 8, work, BUILT_IN["h100"], max_micro_batch=2).ranked[0]
    options = train_options(best.plan, model, work)
    argv = [item for key, value in options.items()
            for item in ([f"--{key.replace('_', '-')}"] if value is True else [f"--{key.replace('_', '-')}", str(value)])]
    args, _ = parse_train_args(["--model", "llama3-70b", *argv])
    shape = run_shape(args, 64)
    plan = build_plan(args, shape, config.n_layers)
    from dtmega.passes import PassManager, Program

    program = Program.build(_meta(config), shape.mesh_sizes(), StepWorkload(4096, shape.micro_batch,
                                                                              shape.accumulation if shape.pp > 1 else None))
    PassManager(plan.passes).annotate(program)
    again = plan_shape_of(program, BUILT_IN["h100"])
    assert (again.tp, again.sp, again.pp, again.vp, again.cp, again.dp, again.dp_mode, again.micro_batch,
            again.recompute, again.cpu_optimizer) == (best.plan.tp, best.plan.sp, best.plan.pp, best.plan.vp,
                                                      best.plan.cp, best.plan.dp, best.plan.dp_mode,
                                                      best.plan.micro_batch, best.plan.recompute,
                                                      best.plan.cpu_optimizer)
    assert memory(model, again, 4096).peak == pytest.approx(best.memory.peak, rel=1e-6)


SEEDS = [  # the seeds' table: model, GPUs, seq, the configuration it recommends
    ("llama3-8b", 8, 4096, 128, "tp=1,pp=1,cp=1"),
    ("llama2-13b", 8, 4096, 128, "tp=2,pp=1,cp=1"),
    ("llama3-70b", 64, 4096, 1024, "tp=4,pp=4,cp=1"),
    ("llama3-405b", 128, 8192, 512, "tp=8,pp=8,cp=2"),
]


@pytest.mark.parametrize("framework", ["dtmega", "megatron-core"])
@pytest.mark.parametrize("name, gpus, seq, batch, seed", SEEDS, ids=[s[0] for s in SEEDS])
def test_plan_reproduces_the_seeds_table(name, gpus, seq, batch, seed, framework, capsys):
    """`dtmega plan`'s best fits 80 GB, and the seeds' configuration is in its top three or the
    output says, with the time components, why its choice is faster (docs/planning.md's table,
    as dtmega and as Megatron-Core run the plans)."""
    start = time.perf_counter()
    plan_main(["--model", name, "--gpus", str(gpus), "--gpu", "h100", "--seq-length", str(seq),
               "--global-batch-size", str(batch), "--compare", seed, "--max-micro-batch", "4",
               "--framework", framework])
    assert time.perf_counter() - start < 30
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("compare "))
    assert " fits (" in line, line
    if "as fast as the best plan" not in line:
        rank = int(line.split(" rank #")[1].split()[0])
        assert rank <= 3 or ("faster; where the time goes:" in line and " s vs the best's " in line), line
    ranked = search(ModelShape.of(LlamaConfig.from_name(name)), gpus, 8, RunWorkload(seq, batch), BUILT_IN["h100"],
                    max_micro_batch=4, framework=framework).ranked
    assert ranked and ranked[0].memory.peak <= 0.9 * BUILT_IN["h100"].memory_bytes  # the planner's headroom


def test_plan_json_lists_the_ranked_plans(capsys):
    """`--json` prints every fitting plan, best first, with the fields the issue names."""
    plan_main(["--model", "llama3-8b", "--gpus", "16", "--gpu", "h100", "--seq-length", "4096",
               "--global-batch-size", "64", "--json", "--max-micro-batch", "2"])
    ranked = json.loads(capsys.readouterr().out)
    assert len(ranked) > 3
    for key in ("tp", "pp", "vp", "cp", "dp", "ep", "micro_batch", "recompute", "memory_gib", "step_s",
                "tokens_per_s_per_gpu", "mfu"):
        assert key in ranked[0], key
    speeds = [row["tokens_per_s_per_gpu"] for row in ranked]
    # best first; plans within 0.1 % count as tied and are ordered by memory, then simplicity
    assert all(a >= b * 0.999 for a, b in zip(speeds, speeds[1:]))
    assert all(row["memory_gib"] <= 0.9 * BUILT_IN["h100"].memory_bytes / 2**30 for row in ranked)


def test_cpu_optimizer_moves_the_optimizer_state_to_the_host():
    """--cpu-optimizer: weights, gradients and Adam state leave the device (predicted)."""
    model = ModelShape.of(LlamaConfig.from_name("llama3-8b"))
    plan = PlanShape(dp=8, dp_mode="fsdp", micro_batch=1, dtype="bfloat16", fused_optimizer=True)
    on_device, offloaded = memory(model, plan, 4096), memory(model, plan.with_(cpu_optimizer=True), 4096)
    state = on_device.weights + on_device.gradients + on_device.optimizer
    assert offloaded.host == pytest.approx(state)
    assert on_device.peak - offloaded.peak >= on_device.optimizer


def test_check_plan_reports_the_budget_and_the_405b_search_is_fast():
    """`check_plan(..., workload)` carries the cost analysis; the 405B search on 1024 GPUs runs in
    well under a minute."""
    layout = dtmega.check_plan(_meta(LlamaConfig.from_name("llama3-8b")), {"dp_shard": 8}, [DataParallel()],
                               workload=StepWorkload(4096, 1), hardware="h100")
    rows = [str(cell) for cell in layout.cost.table().columns[0].cells]
    assert any("memory: peak" in row for row in rows) and any("step time" in row for row in rows)
    start = time.perf_counter()
    result = search(ModelShape.of(LlamaConfig.from_name("llama3-405b")), 1024, 8, RunWorkload(8192, 2048),
                    BUILT_IN["h100"], max_micro_batch=4)
    assert time.perf_counter() - start < 60 and result.ranked


def test_bad_inputs_name_the_fix(tmp_path):
    with pytest.raises(PlanArgumentError, match="unknown; choose one of"):
        plan_main(["--model", "nope", "--gpus", "8", "--seq-length", "8", "--global-batch-size", "8"])
    with pytest.raises(PlanArgumentError, match="whole number of nodes"):
        plan_main(["--model", "llama3-8b", "--gpus", "12", "--seq-length", "8", "--global-batch-size", "8"])
    with pytest.raises(HardwareError, match="dtmega calibrate"):
        load_hardware(tmp_path / "missing.toml")
    bad = tmp_path / "hw.toml"
    bad.write_text('name = "x"\nmemory_bytes = 1.0\nflops = 3\n')
    with pytest.raises(HardwareError, match="unknown key"):
        load_hardware(bad)
    with pytest.raises(PlanArgumentError, match="no plan for"):
        plan_main(["--model", "llama3-405b", "--gpus", "8", "--seq-length", "8192", "--global-batch-size", "8"])
    written = tmp_path / "ok.toml"
    BUILT_IN["a100"].to_toml(written)
    assert load_hardware(written) == Hardware(**{**BUILT_IN["a100"].__dict__, "source": str(written)})


def test_auto_plan_sets_the_winners_options():
    """`dtmega train --auto-plan` takes the search's winner for its world size (the same pure
    function on every rank), refuses parallelism flags given beside it, and on a CPU asks for a
    hardware file."""
    from dtmega.models import model_spec
    from dtmega.train.args import ArgumentError, parse_train_args
    from dtmega.train.auto_plan import apply_auto_plan
    from dtmega.train.setup import build_plan, run_shape

    config = LlamaConfig.from_name("llama3-70b")
    base = ["--model", "llama3-70b", "--auto-plan", "--hardware", "h100", "--global-batch-size", "1024",
            "--seq-length", "4096", "--bf16"]
    args, _ = parse_train_args(base)
    args, note = apply_auto_plan(args, model_spec("llama3-70b"), config, 64)
    best = search(ModelShape.of(config), 64, 8, RunWorkload(4096, 1024), BUILT_IN["h100"]).ranked[0]
    assert best.plan.describe() in note and "--auto-plan on 64 x h100" in note
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size,
            args.micro_batch_size) == (best.plan.tp, best.plan.pp, best.plan.cp, best.plan.micro_batch)
    shape = run_shape(args, 64)
    assert shape.dp == best.plan.dp and build_plan(args, shape, config.n_layers)
    with pytest.raises(ArgumentError, match="--auto-plan chooses --tensor-model-parallel-size"):
        apply_auto_plan(parse_train_args([*base, "--tensor-model-parallel-size", "2"])[0], model_spec("llama3-70b"),
                        config, 64)
    cpu, _ = parse_train_args([arg for arg in base if arg not in ("--hardware", "h100")])
    if not torch.cuda.is_available():
        with pytest.raises(ArgumentError, match="dtmega calibrate"):
            apply_auto_plan(cpu, model_spec("llama3-70b"), config, 64)


def test_calibrate_writes_a_file_the_planner_reads(tmp_path, capsys):
    """`dtmega calibrate` on 2 local processes writes a hardware file with this machine's rates
    (positive, finite), `dtmega plan --gpu FILE` ranks plans with it, and a second run refuses to
    overwrite the file before measuring anything."""
    import math
    import os
    import subprocess
    import sys

    out = tmp_path / "cpu2.toml"
    command = [sys.executable, "-m", "dtmega", "calibrate", "--ranks", "2", "--seconds", "0.05", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    hardware = load_hardware(out)
    figures = [hardware.flops("float32"), hardware.memory_bandwidth, hardware.intra_node_bandwidth,
               hardware.intra_node_latency, hardware.op_overhead, hardware.efficiency, hardware.memory_bytes]
    assert all(value > 0 and math.isfinite(value) for value in figures), hardware
    assert hardware.flops("float32") > 1e8 and hardware.gpus_per_node == 2
    plan_main(["--model", "debug", "--gpus", "2", "--gpus-per-node", "2", "--gpu", str(out), "--seq-length", "64",
               "--global-batch-size", "8", "--json"])
    ranked = json.loads(capsys.readouterr().out)
    assert ranked and all(row["step_s"] > 0 for row in ranked)
    written = out.read_bytes()
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 2 and "never overwrites" in again.stderr and out.read_bytes() == written
