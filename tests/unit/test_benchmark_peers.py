"""Before benchmarks/gpu_step.py may say dtmega beats a peer, the peer gets what its maintainers
intend: Liger's fused linear cross entropy bf16 hidden states and a bf16 weight outside
autocast (the old benchmark called it inside autocast on fp32 tensors and measured Liger 3 %
slower than no Liger, where set up right it is 7 % faster); torchao float8 the recipe's own
config and torchao's own module filter (not a filter of ours); torchtitan its float8 converter
as its docs configure it. Then the driver's method: every system swept over micro-batches,
final repeats in fresh processes in a seeded shuffle, and a ratio claimed only beyond the
spread; and `--tiny` runs every system for real (on the CPU: the logic, not a timing)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_step
from benchmarks.step_systems import SYSTEMS, build, model_config, torchao_float8, torchtitan_config

ROOT = Path(__file__).resolve().parents[2]


def test_liger_gets_bf16_tensors_outside_autocast_and_the_master_weight_its_gradient(interpret, monkeypatch):
    if not interpret:
        return
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    seen = []
    forward = LigerFusedLinearCrossEntropyLoss.forward

    def spy(self, weight, hidden, target, *args, **kwargs):
        seen.append((weight.dtype, hidden.dtype, torch.is_autocast_enabled("cpu"), weight.requires_grad))
        return forward(self, weight, hidden, target, *args, **kwargs)

    monkeypatch.setattr(LigerFusedLinearCrossEntropyLoss, "forward", spy)
    setup = build(SYSTEMS["plain+liger"], None, model_config(tiny=True), "cpu", "eager")
    master = setup.model.output.weight
    before = master.detach().clone()
    tokens = torch.randint(0, 512, (2, 17))
    loss = setup.step(tokens[:, :-1], tokens[:, 1:])
    assert seen == [(torch.bfloat16, torch.bfloat16, False, True)]
    assert master.dtype == torch.float32 and not torch.equal(master.detach(), before)  # the fp32 master was updated
    assert torch.isfinite(loss)


def _linears(model):
    return {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_float8_gets_the_recipes_config_and_torchaos_own_filter(recipe, monkeypatch):
    """At the benchmark's size (the 1.50 B model on the meta device): the config is
    `from_recipe_name(recipe)` and the modules converted are exactly those torchao's
    `_auto_filter_for_recipe` keeps (the output layer named out), not a filter of ours."""
    import torchao.float8 as ao

    from dtmega.models import Llama

    calls = []
    convert = ao.convert_to_float8_training
    monkeypatch.setattr(ao, "convert_to_float8_training",
                        lambda model, **kwargs: calls.append(kwargs) or convert(model, **kwargs))
    with torch.device("meta"):
        model = Llama(model_config(tiny=False))
    keep = ao._auto_filter_for_recipe(recipe, filter_fqns=["output"])
    expected = sorted(name for name, module in _linears(model).items() if keep(module, name))
    notes = torchao_float8(model, recipe)
    (kwargs,) = calls
    assert kwargs["config"] == ao.Float8LinearConfig.from_recipe_name(recipe)
    converted = sorted(name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear")
    assert converted == expected and notes["float8_converted"] == len(expected) > 0
    assert "output" not in converted


def test_torchtitan_float8_is_its_converter_as_its_config_registry_sets_it():
    from torchtitan.components.quantization import Float8Linear

    config = torchtitan_config(tiny=False, recipe="rowwise", compiled=True)
    converted = [fqn for fqn, _, _, _ in config.traverse(Float8Linear.Config)]
    assert len(converted) == 16 * 5 and not any("lm_head" in fqn for fqn in converted)  # every block linear
    assert not config.enable_weight_tying  # untied, as the benchmark's model
    plain = torchtitan_config(tiny=False, recipe=None, compiled=True)
    assert not list(plain.traverse(Float8Linear.Config))


def test_plain_and_dtmega_compute_in_bf16_with_fp32_master_weights():
    """The plain script's matmuls run in bf16 under autocast; dtmega's one-rank plan runs the
    same autocast (DataParallel on one rank); both keep fp32 parameters. (Blocks not compiled:
    a hook inside a compiled block does not fire.)"""
    for name in ("plain", "dtmega"):
        setup = build(SYSTEMS[name], None, model_config(tiny=True), "cpu", "none")
        dtypes = []
        wq = setup.model.get_submodule("layers.0.attention.wq")
        handle = wq.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
        tokens = torch.randint(0, 512, (2, 17))
        setup.step(tokens[:, :-1], tokens[:, 1:])
        handle.remove()
        assert dtypes == [torch.bfloat16], name
        assert {p.dtype for p in setup.model.parameters()} == {torch.float32}, name


def _args(tmp_path: Path, **overrides) -> argparse.Namespace:
    args = gpu_step.parse(["--tiny", "--results", str(tmp_path)])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_the_sweep_picks_each_systems_fastest_micro_batch_and_recipe_and_finals_are_shuffled_fresh_runs(tmp_path):
    """With a fake runner: every system and recipe swept over the micro-batches, the fastest
    kept (an out-of-memory point ends the sweep), then each kept configuration --repeats
    times, one run (one process) per repeat, in the order a seeded shuffle gives."""
    speed = {("plain", None): {1: 100.0, 2: 150.0}, ("dtmega+fp8", "tensorwise"): {1: 90.0, 2: 140.0},
             ("dtmega+fp8", "rowwise"): {1: 95.0, 2: 180.0}}
    calls = []

    def fake(args, system, recipe, micro_batches, phase, repeat, order):
        calls.append((system, recipe, tuple(micro_batches), phase, repeat, order))
        rows = [{"micro_batch": mb, "tokens_per_s": speed[(system, recipe)][mb] + (repeat or 0), "mfu": 0.5,
                 "peak_gib": None} for mb in micro_batches if mb in speed[(system, recipe)]]
        rows += [{"micro_batch": 3, "out_of_memory": True}] if phase == "sweep" else []
        record = {"system": system, "recipe": recipe, "phase": phase, "repeat": repeat, "order": order, "rows": rows}
        gpu_step.run_file(args.results, phase, system, recipe, repeat).write_text(json.dumps(record))
        return record

    args = _args(tmp_path, micro_batches=[1, 2, 3], repeats=3, seed=7)
    systems = [SYSTEMS["plain"], SYSTEMS["dtmega+fp8"]]
    gpu_step.sweep(args, systems, fake)
    assert [c[:4] for c in calls] == [("plain", None, (1, 2, 3), "sweep"), ("dtmega+fp8", "tensorwise", (1, 2, 3), "sweep"),
                                      ("dtmega+fp8", "rowwise", (1, 2, 3), "sweep")]
    assert gpu_step.best_configurations(gpu_step.load_records(tmp_path)) == {
        "plain": (None, 2, 150.0), "dtmega+fp8": ("rowwise", 2, 180.0)}
    calls.clear()
    gpu_step.final(args, systems, fake)
    order = [(system, repeat) for system, _, _, _, repeat, _ in calls]
    assert order == gpu_step.final_order({"plain": 0, "dtmega+fp8": 0}, 3, 7)
    assert sorted(order) == sorted((s, r) for s in ("plain", "dtmega+fp8") for r in range(3))
    assert order != sorted(order) and [c[5] for c in calls] == list(range(6))
    assert {c[:3] for c in calls} == {("plain", None, (2,)), ("dtmega+fp8", "rowwise", (2,))}
    assert gpu_step.final_order({"a": 0, "b": 0}, 5, 1) != gpu_step.final_order({"a": 0, "b": 0}, 5, 2)


def _final(system: str, speeds: list[float]) -> list[dict]:
    return [{"system": system, "recipe": None, "phase": "final", "repeat": i,
             "rows": [{"micro_batch": 8, "tokens_per_s": s, "mfu": s / 1e5, "peak_gib": 40.0}]}
            for i, s in enumerate(speeds)]


def test_a_ratio_is_claimed_only_beyond_the_spread():
    ahead = gpu_step.summarize(_final("dtmega+kernels", [105, 106, 107, 106, 105])
                               + _final("plain+liger", [100, 101, 102, 100, 101]))
    assert ahead["comparisons"]["bf16"]["verdict"] == "ahead, beyond the spread"
    assert ahead["systems"]["plain+liger"]["median_tokens_per_s"] == 101
    close = gpu_step.summarize(_final("dtmega", [100, 103, 101, 102, 100]) + _final("plain", [99, 101, 100, 102, 100]))
    assert close["comparisons"]["bf16"]["verdict"] == "within the spread: no claim"
    behind = gpu_step.summarize(_final("dtmega+fp8", [90, 91]) + _final("torchtitan+float8", [95, 96]))
    assert behind["comparisons"]["fp8"]["verdict"] == "behind, beyond the spread"
    assert behind["comparisons"]["fp8"]["ratio"] == pytest.approx(90.5 / 95.5)


def test_tiny_runs_every_system_through_sweep_final_and_table(tmp_path):
    """`gpu_step.py --tiny --in-process`: every system really runs (Liger interpreted, torchao,
    torchtitan, dtmega) through the sweep, 2 repeats of each final configuration, and the table."""
    out = tmp_path / "summary.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_step.py"), "--tiny", "--in-process",
                           "--repeats", "2", "--steps", "1", "--sweep-steps", "1", "--warmup", "0",
                           "--results", str(tmp_path / "runs"), "--out", str(out)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert not summary["errors"] and not summary["not_run"], summary
    assert set(summary["systems"]) == set(SYSTEMS)
    assert all(s["repeats"] == 2 for s in summary["systems"].values())
    assert {s["recipe"] for n, s in summary["systems"].items() if SYSTEMS[n].float8} <= {"tensorwise", "rowwise"}
    assert set(summary["comparisons"]) == {"bf16", "fp8"}
    assert {"torch", "liger_kernel", "torchao", "torchtitan", "dtmega_commit"} <= set(summary["versions"])
    sweeps = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("sweep-*.json")]
    assert len(sweeps) == sum(len(s.recipes) for s in SYSTEMS.values())
    assert all([r["micro_batch"] for r in s["rows"]] == [1, 2] for s in sweeps)


def test_final_runs_are_one_shuffled_order_run_in_chunks():
    order = [f"run{i}" for i in range(11)]
    pieces = [gpu_step.chunk_of(order, f"{k}/4") for k in range(1, 5)]
    assert [item for piece in pieces for item in piece] == list(enumerate(order))
    assert [len(piece) for piece in pieces] == [3, 3, 3, 2]
    with pytest.raises(SystemExit, match="K must be in 1..N"):
        gpu_step.chunk_of(order, "5/4")


def test_gpu_check_dry_run_lists_every_gpu_step_with_its_expected_time(capsys):
    """`make gpu-check DRY_RUN=1`: the step table's sweep and final chunks, the CUDA numerics,
    the kernels, the FP8 loss curve, the offload memory and packed documents, each a call under
    10 minutes."""
    from benchmarks import gpu_check

    assert gpu_check.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split("min", 1)[1].split()[0] for line in lines[:-1]]
    assert {"sweep", "final", "step", "numerics", "kernels", "fp8", "offload", "packed"} == set(names)
    assert all(float(line.split("min")[0]) < 10 for line in lines[:-1])
    assert "min in all" in lines[-1]
