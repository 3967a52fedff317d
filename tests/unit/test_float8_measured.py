"""Float8's measured precision per projection (issue 36): with a measurement (a fake timer here,
the GPU in a run) each eligible linear runs in FP8 only where FP8 measured faster at its per-rank
shape, not by a fixed `min_features`; the choice and both times are in the layout and notes, kept
on disk and read back; tensor parallelism's split shapes are what is measured; and where nothing
can be measured the size rule decides, or `measure=True` is refused before launch."""

from __future__ import annotations

import pytest
import torch

import dtmega
from dtmega.passes import Float8, Plan, PlanError, SequenceParallel, TensorParallel, Workload
from tests.helpers import debug_llama

WORKLOAD = Workload(seq_len=64, micro_batch=4)


def _model():
    with torch.device("meta"):
        return dtmega.models.Llama(debug_llama())


class WidthTimer:
    """FP8 wins only where both sides are at least `wide`; records what was measured."""

    def __init__(self, wide: int):
        self.wide, self.measured = wide, []

    def __call__(self, shape, candidate: str) -> float:
        self.measured.append((shape, candidate))
        fast = min(shape.in_features, shape.out_features) >= self.wide
        return {"fp8": 1.0 if fast else 2.0, "bf16": 1.5}[candidate]


def _precision(layout) -> dict[str, str]:
    return {fqn: str(entry.precision) for fqn, entry in layout.modules.items()
            if fqn.startswith("layers.0.") and fqn.endswith(("wq", "wk", "wv", "wo", "w1", "w2", "w3"))}


def test_each_projection_takes_the_precision_that_measured_faster(tmp_path):
    timer = WidthTimer(64)
    cache = tmp_path / "choices.json"
    # min_features=4096 would keep every linear bf16: the measurement decides instead
    plan = Plan([Float8(min_features=4096, timer=timer, cache=str(cache))])
    layout = dtmega.check_plan(_model(), {}, plan, workload=WORKLOAD)
    precision = _precision(layout)
    # debug: dim 64, k/v 64 -> 32, FFN 64 <-> 128
    for name in ("attention.wq", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
        assert precision[f"layers.0.{name}"] == "fp8 delayed hybrid", name
    for name in ("attention.wk", "attention.wv"):
        assert precision[f"layers.0.{name}"].startswith("bf16: measured: bf16 is as fast or faster at 64->32"), name
    shapes = {shape for shape, _ in timer.measured}
    assert {(s.tokens, s.in_features, s.out_features) for s in shapes} == {(256, 64, 64), (256, 64, 32),
                                                                            (256, 64, 128), (256, 128, 64)}
    assert "(bf16 (1500.00 ms; fp8 2000.00))" in precision["layers.0.attention.wk"]  # both times, in the report
    # read back from the file: nothing measured again
    def refuse(shape, candidate):
        raise AssertionError("measured again")

    again = dtmega.check_plan(_model(), {}, Plan([Float8(min_features=4096, timer=refuse, cache=str(cache))]),
                              workload=WORKLOAD)
    assert {fqn: reason.replace(" [cached]", "") for fqn, reason in _precision(again).items()} == precision
    assert "[cached]" in _precision(again)["layers.0.attention.wk"]


def test_tensor_parallel_shapes_are_measured_per_rank(tmp_path):
    timer = WidthTimer(64)
    plan = Plan([TensorParallel(), SequenceParallel(), Float8(timer=timer, cache=str(tmp_path / "c.json"))])
    layout = dtmega.check_plan(_model(), {"tp": 2}, plan, workload=WORKLOAD)
    measured = {(s.in_features, s.out_features) for s, _ in timer.measured}
    # column-parallel: outputs halved (wq 64->32, wk/wv 64->16, w1/w3 64->64); row-parallel: inputs (wo 32->64, w2 64->64)
    assert measured == {(64, 32), (64, 16), (64, 64), (32, 64)}
    precision = _precision(layout)
    assert precision["layers.0.feed_forward.w1"] == "fp8 delayed hybrid"
    assert precision["layers.0.attention.wq"].startswith("bf16: measured")


def test_without_a_measurement_the_size_rule_decides_and_insisting_is_refused(tmp_path):
    # no GPU here and no timer: min_features decides, as before
    layout = dtmega.check_plan(_model(), {}, Plan([Float8(min_features=16)]), workload=WORKLOAD)
    assert set(_precision(layout).values()) == {"fp8 delayed hybrid"}
    # measure=False ignores even a timer
    never = dtmega.check_plan(_model(), {}, Plan([Float8(min_features=16, measure=False, timer=WidthTimer(10**6))]),
                              workload=WORKLOAD)
    assert set(_precision(never).values()) == {"fp8 delayed hybrid"}
    with pytest.raises(PlanError, match="no workload gives the shapes"):
        dtmega.check_plan(_model(), {}, Plan([Float8(measure=True, timer=WidthTimer(1))]))
    with pytest.raises(PlanError, match="nothing to measure on"):
        dtmega.check_plan(_model(), {}, Plan([Float8(measure=True)]), workload=WORKLOAD)


def test_the_trainer_flag_sets_how_precision_is_chosen():
    from dtmega.train.args import ArgumentError, parse_train_args

    def measure(*flags):
        (fp8,) = parse_train_args(["--fp8-hybrid", *flags])[0].fp8_passes()
        return fp8.measure

    assert measure() is None  # auto: measured where a GPU is, min_features elsewhere
    assert measure("--fp8-precision", "measure") is True
    assert measure("--fp8-precision", "size", "--fp8-min-features", "512") is False
    with pytest.raises(ArgumentError, match="fp8-precision"):
        parse_train_args(["--fp8-hybrid", "--fp8-precision", "fast"])
