"""The Float8 pass as a plan decision: which linears it puts in FP8 and why the others stay bf16,
what it refuses before launch, and how Megatron's --fp8-* flags map onto it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

import dtmega
from dtmega.passes import DataParallel, Float8, Plan, PlanError, SequenceParallel, TensorParallel
from dtmega.passes.render import layout_table
from dtmega.train.args import ArgumentError, parse_train_args
from dtmega.train.setup import build_plan, run_shape
from tests.helpers import debug_llama, full, relative_error

ROOT = Path(__file__).resolve().parents[2]


def _model(**overrides):
    with torch.device("meta"):
        return dtmega.models.Llama(debug_llama(**overrides))


def _linears(layout) -> dict[str, str]:
    return {fqn: str(entry.precision) for fqn, entry in layout.modules.items()
            if fqn.endswith(("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output"))}


def test_annotate_marks_each_linear_and_says_why_the_others_stay_bf16():
    plan = Plan([TensorParallel(), SequenceParallel(), Float8(min_features=64, first_blocks_bf16=1,
                                                                last_blocks_bf16=1), DataParallel("fsdp")])
    layout = dtmega.check_plan(_model(), {"tp": 2, "dp_shard": 2}, plan)
    precision = _linears(layout)
    assert precision["output"].startswith("bf16: the output layer stays bf16")
    for block in (0, 3):
        assert precision[f"layers.{block}.attention.wq"] == "bf16: first/last blocks kept in bf16"
    for block in (1, 2):
        for name in ("attention.wq", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
            fqn = f"layers.{block}.{name}"
            assert precision[fqn] == "fp8 delayed hybrid" and layout[fqn].kernel == "linear.float8.dtmega", fqn
    # Debug's k/v projections are 64 -> 32 wide: below min_features=64, FP8 loses there.
    assert "too small for FP8 to win (64x32 < 64" in precision["layers.1.attention.wk"]
    # The default size filter (1024) keeps every linear of this tiny model in bf16, saying so.
    default = _linears(dtmega.check_plan(_model(), {}, Plan([Float8()])))
    assert all(p.startswith("bf16: ") for p in default.values())
    # Dimensions FP8 GEMMs refuse (not multiples of 16) are named.
    odd = _linears(dtmega.check_plan(_model(ffn_dim=136), {}, Plan([Float8(min_features=16)])))
    assert "divisible by 16 (64x136)" in odd["layers.0.feed_forward.w1"]
    # The report shows each module's precision.
    console = Console(width=250, record=True)
    console.print(layout_table(layout, fold=False))
    report = console.export_text()
    assert "fp8 delayed hybrid" in report and "first/last blocks kept in bf16" in report


@pytest.mark.parametrize("kwargs, message", [
    ({"recipe": "fp4"}, "Float8\\(recipe='fp4'\\) is unknown"),
    ({"format": "e5m2"}, "Float8\\(format='e5m2'\\) is unknown"),
    ({"amax_history_len": 0}, "amax_history_len >= 1"),
    ({"recipe": "mxfp8"}, "the mxfp8 recipe runs on Transformer Engine only"),
    ({"recipe": "blockwise"}, "the blockwise recipe runs on Transformer Engine only"),
    ({"backend": "torchao", "recipe": "delayed"}, "torchao no longer offers delayed scaling"),
    ({"backend": "torchao", "recipe": "tensorwise", "format": "e4m3"}, "torchao's tensorwise recipe is hybrid"),
    ({"backend": "torchao", "recipe": "rowwise", "format": "hybrid"}, "torchao's rowwise recipe is e4m3"),
    ({"backend": "torchao", "recipe": "rowwise", "format": "e4m3", "param_gather": True},
     "backend 'torchao' does it for tensorwise, not rowwise"),
    ({"recipe": "rowwise", "param_gather": True}, "backend 'dtmega' does it for delayed and tensorwise, not rowwise"),
])
def test_unusable_recipes_are_refused_at_check_time(kwargs, message):
    with pytest.raises(PlanError, match=message):
        dtmega.check_plan(_model(), {}, Plan([Float8(**kwargs)]))


@pytest.mark.parametrize("shape, data_parallel", [({}, []), ({"dp_replicate": 2}, [DataParallel("ddp")])],
                         ids=["no data parallelism", "ddp"])
def test_fp8_all_gather_needs_sharded_weights(shape, data_parallel):
    with pytest.raises(PlanError, match="this plan shards no weights. Fix: DataParallel\\('fsdp'\\)"):
        dtmega.check_plan(_model(), shape, Plan([Float8(param_gather=True, min_features=16), *data_parallel]))


@pytest.mark.skipif(__import__("importlib").util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed here: its refusal cannot be shown")
def test_a_backend_that_is_not_installed_names_the_install_command():
    with pytest.raises(PlanError, match=r"needs transformer_engine, which is not installed. Fix: pip install "
                                        r"'dtmega\[te\]'"):
        dtmega.check_plan(_model(), {}, Plan([Float8(backend="transformer_engine")]))


def test_torchao_backend_computes_what_dtmegas_own_does(one_rank_mesh):
    """The same recipe (tensorwise, hybrid) on both backends, one rank, one step: the same FP8
    math on the same values, so only fp32 rounding differs (measured 1.4e-5 on the worst
    gradient). Bound 1e-3: an element on an FP8 rounding boundary may round the other way when
    the backends scale in another order (one e4m3 ulp of one element of a 4096-element tensor
    is ~2e-3 of its norm at worst); a wrong format or scale is >= 5e-2."""
    grid = dtmega.make_mesh(dp_shard=1)  # on the fixture's 1-rank world
    results = {}
    for backend in ("dtmega", "torchao"):
        pm = dtmega.parallelize(_model(), grid, Plan([
            Float8(backend=backend, recipe="tensorwise", min_features=16), DataParallel("fsdp")]))
        pm.init_weights(seed=3)
        loss = pm.forward_backward(pm.shard_batch(dtmega.synthetic_batch(4, 32, 256, seed=5, masked_fraction=0.25)))
        results[backend] = loss, {name: full(p.grad) for name, p in pm.named_parameters()}
    (loss, grads), (loss_ao, grads_ao) = results["dtmega"], results["torchao"]
    assert relative_error(loss_ao, loss) < 1e-4
    assert max(relative_error(grads_ao[name], grad) for name, grad in grads.items()) < 1e-3
    fp32 = dtmega.parallelize(_model(), grid, Plan([DataParallel("fsdp")]))
    fp32.init_weights(seed=3)
    fp32.forward_backward(fp32.shard_batch(dtmega.synthetic_batch(4, 32, 256, seed=5, masked_fraction=0.25)))
    noise = max(relative_error(full(p.grad), grads[name]) for name, p in fp32.named_parameters())
    assert noise > 1e-2, "FP8 left the gradients unchanged: the linears did not run in FP8"


def test_megatron_fp8_flags_map_onto_the_pass():
    args, _ = parse_train_args(["--fp8-hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
                                "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "2"])
    (fp8,) = args.fp8_passes()
    assert (fp8.recipe, fp8.format, fp8.backend, fp8.amax_history_len, fp8.amax_compute_algo) == (
        "delayed", "hybrid", "dtmega", 1024, "max")
    assert (fp8.first_blocks_bf16, fp8.last_blocks_bf16) == (1, 2)
    args, _ = parse_train_args(["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--tensor-model-parallel-size",
                                "2"])
    plan = build_plan(args, run_shape(args, 4), 4)
    assert any(isinstance(p, Float8) and (p.format, p.recipe) == ("e4m3", "tensorwise") for p in plan.passes)
    assert parse_train_args([])[0].fp8_passes() == []
    (gather,) = parse_train_args(["--fp8-hybrid", "--fp8-param-gather"])[0].fp8_passes()
    assert (gather.backend, gather.recipe, gather.param_gather) == ("dtmega", "delayed", True)
    with pytest.raises(ArgumentError, match="--fp8-param-gather need\\(s\\) FP8: add --fp8-format hybrid"):
        parse_train_args(["--fp8-param-gather"])[0].fp8_passes()
    with pytest.raises(ArgumentError, match="--fp8-hybrid and --fp8-format e4m3 disagree"):
        parse_train_args(["--fp8-hybrid", "--fp8-format", "e4m3"])[0].fp8_passes()


@pytest.mark.skipif(__import__("importlib").util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed here: the seeds' command line would run")
def test_the_seeds_fp8_command_line_stops_before_any_work(tmp_path):
    """--fp8-hybrid with --transformer-impl transformer_engine where TE is missing: exit 2, one line
    naming the missing package and the fix, before any data or checkpoint directory is touched."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(f'{{"text": "line {i} of a tiny corpus"}}' for i in range(200)))
    prep = subprocess.run([sys.executable, "-m", "dtmega", "preprocess", "--input", str(corpus), "--output-prefix",
                           str(tmp_path / "corpus"), "--tokenizer-type", "byte", "--append-eod", "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert prep.returncode == 0, prep.stderr[-2000:]
    save = tmp_path / "ckpt"
    command = [sys.executable, "-m", "dtmega", "train", "--swiglu", "--num-layers", "2", "--hidden-size", "64",
               "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--lr", "1e-3",
               "--tokenizer-type", "byte", "--data-path", str(tmp_path / "corpus_text_document"),
               "--save", str(save), "--train-iters", "2", "--fp8-hybrid", "--fp8-amax-history-len", "1024",
               "--fp8-amax-compute-algo", "max", "--transformer-impl", "transformer_engine"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "needs transformer_engine, which is not installed. Fix: pip install 'dtmega[te]'" in done.stderr
    assert "or --transformer-impl local (dtmega's own FP8 linear)" in done.stderr  # the fix as a flag
    assert "backend=" not in done.stderr
    assert not save.exists()


def test_delayed_scaling_history_takes_training_passes_only(one_rank_mesh):
    """Validation data must not move the training run's scales (a run's losses would then
    depend on --eval-interval), and neither may the stand-in tensors a pipeline stage runs to
    infer shapes (the float64 PP2 check in tests/distributed/test_float8.py caught that one):
    delayed scaling records amaxes only in training passes with gradients."""
    from dtmega.passes.float8 import Float8Scaling

    pm = dtmega.parallelize(_model(), dtmega.make_mesh(dp_shard=1), Plan([
        Float8(recipe="delayed", amax_history_len=4, min_features=16), DataParallel("fsdp")]))
    pm.init_weights(seed=3)
    states = list(pm.hook(Float8Scaling).states.values())
    batch = pm.shard_batch(dtmega.synthetic_batch(4, 32, 256, seed=5, masked_fraction=0.25))
    pm.eval()
    with torch.no_grad():
        pm.loss_sum(batch)
    assert all(not state.current.any() for state in states), "an evaluation pass recorded amaxes"
    pm.train()
    linears = [m for m in pm.module.modules() if getattr(m, "counting", None) is not None]
    assert len(linears) == len(states)
    for linear in linears:  # what a pipeline stage does around its shape inference
        linear.counting = False
    pm.forward_backward(batch)
    assert all(not state.current.any() for state in states), "a pass with counting off recorded amaxes"
    for linear in linears:
        linear.counting = True
    pm.forward_backward(batch)
    assert all(state.current.all() for state in states), "a training step left amaxes unrecorded"
