"""The layout IR and plans as data: TOML round trips, diffs, rendering, shard arithmetic."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

import dtmega
from dtmega.models import Llama, LlamaConfig
from dtmega.passes import (
    DataParallel,
    Layout,
    ParamLayout,
    Plan,
    PlanError,
    Recompute,
    Rule,
    SequenceParallel,
    TensorParallel,
)
from dtmega.passes.rules import glob_match

MESH = {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2}
PLAN = Plan([TensorParallel(rules=[Rule("layers.0.feed_forward.w?", "none")]), SequenceParallel(),
             Recompute("selective", every=2), DataParallel("fsdp", param_dtype="bfloat16")])


def layout() -> Layout:
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("debug"))
    return dtmega.check_plan(model, MESH, PLAN)


def test_layout_records_every_decision():
    lay = layout()
    wq = lay["layers.1.attention.wq"]
    assert wq.style == "colwise" and wq.params["weight"].placements == {"tp": "S(0)", "dp_shard": "S(0)"}
    assert lay["layers.1.attention.wo"].outputs == {"tp": "P->S(1)"}
    assert lay["layers.0.feed_forward.w2"].style is None  # removed by the user's 'none' rule (the whole MLP)
    assert lay["layers.1.attention_norm"].inputs == {"tp": "S(1)"}
    assert lay["output"].inputs == {"tp": "S(1)->R"}
    assert lay["layers.1.attention.core"].recompute == "selective"
    assert lay["layers.0.attention.core"].recompute is None
    assert lay["layers.3"].wrap == "fsdp" and str(lay[""].precision) == "param=bf16 reduce=fp32"


def test_a_rule_that_leaves_one_linear_of_a_sharded_mlp_whole_is_refused():
    """Removing w2 alone from TP leaves it whole where w1 and w3 shard the hidden units: each rank
    would apply it to its own units and update its copy with a partial gradient. The plan is
    refused naming the parameter (passes/accounting.py); removing the whole MLP is a plan."""
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("debug"))
    with pytest.raises(PlanError, match=r"layers\.0\.feed_forward\.w2\.weight lie\(s\) where activations are sharded"):
        dtmega.check_plan(model, {"tp": 2}, Plan([TensorParallel(rules=[Rule("layers.0.feed_forward.w2", "none")])]))


def test_layout_toml_round_trip_and_diff():
    lay = layout()
    again = Layout.from_toml(lay.to_toml())
    assert again.diff(lay) == [] and again.to_dict() == lay.to_dict()
    again["output"].params["weight"].placements["tp"] = "R"
    changes = again.diff(lay)
    assert len(changes) == 1 and changes[0].fqn == "output" and changes[0].field == "params"


def test_layout_file_round_trip(tmp_path):
    lay = layout()
    lay.to_toml(tmp_path / "layout.toml")
    assert Layout.from_toml(str(tmp_path / "layout.toml")).diff(lay) == []
    with pytest.raises(FileNotFoundError):
        Layout.from_toml(str(tmp_path / "missing.toml"))


def test_local_shapes_follow_torch_chunk_semantics():
    # 10 rows over tp=4: chunks of 3,3,3,1; then FSDP over 4 splits the TP shard of 3: 1,1,1,0.
    param = ParamLayout(shape=(10, 6), placements={"tp": "S(0)", "dp_shard": "S(0)"})
    sizes = {"tp": 4, "dp_shard": 4}
    assert param.local_shape(sizes) == (1, 6)
    assert param.local_shape(sizes, {"tp": 3, "dp_shard": 0}) == (1, 6)
    assert param.local_shape(sizes, {"tp": 3, "dp_shard": 1}) == (0, 6)
    assert ParamLayout(shape=(10, 6), placements={"tp": "S(1)"}).local_shape({"tp": 4}) == (10, 2)


def test_report_renders_folded_blocks_and_per_rank_bytes():
    console = Console(file=io.StringIO(), width=220)
    console.print(layout())
    text = console.file.getvalue()
    assert "layers.*.attention.wq  (x4)" in text
    assert "tp:S(0) dp_shard:S(0)" in text
    assert "parameters on rank 0" in text


def test_plan_toml_round_trip(tmp_path):
    text = PLAN.to_toml()
    assert "TensorParallel" in text and "layers.0.feed_forward.w?" in text
    assert Plan.from_toml(text) == PLAN
    path = tmp_path / "plan.toml"
    PLAN.to_toml(path)
    assert Plan.from_toml(path) == PLAN


def test_plan_toml_errors():
    with pytest.raises(PlanError, match="unknown pass 'Pipeline'"):
        Plan.from_toml('[[passes]]\npass = "Pipeline"\n')
    with pytest.raises(PlanError, match=r"has no option\(s\) \['degree'\]"):
        Plan.from_toml('[[passes]]\npass = "TensorParallel"\ndegree = 2\n')
    with pytest.raises(PlanError, match="not valid TOML"):
        Plan.from_toml("[[passes]\n")
    with pytest.raises(PlanError, match="takes pass instances"):
        Plan(["TensorParallel"])


@pytest.mark.parametrize(
    "pattern, fqn, expected",
    [
        ("layers.*.attention.wq", "layers.7.attention.wq", True),
        ("layers.*.attention.wq", "layers.7.x.attention.wq", False),
        ("**.w1", "layers.0.feed_forward.w1", True),
        ("**.w1", "w1", True),
        ("layers.**", "layers", True),
        ("layers.**", "layers.0.attention", True),
        ("a.**.b", "a.b", True),
        ("a.**.b", "a.x.y.b", True),
        ("layers.1*", "layers.12", True),
        ("layers.1*", "layers.2", False),
        ("output", "output_norm", False),
    ],
)
def test_rule_globs_match_by_component(pattern, fqn, expected):
    assert glob_match(pattern, fqn) is expected
