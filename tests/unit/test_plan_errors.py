"""Every bad plan fails in `check_plan` (pure: no process group, no tensor) with a message that
names the problem and the fix."""

from __future__ import annotations

import pytest
import torch

import dtmega
from dtmega.mesh import resolve_mesh_sizes
from dtmega.models import Llama, LlamaConfig
from dtmega.passes import DataParallel, Plan, PlanError, Recompute, Rule, SequenceParallel, TensorParallel
from tests.helpers import mesh_shape


def meta_llama(**overrides):
    with torch.device("meta"):
        return Llama(LlamaConfig.from_name("debug", **overrides))


def check(model, sizes, passes):
    return dtmega.check_plan(model, mesh_shape(**sizes), Plan(passes))


def test_heads_not_divisible_by_tp():
    with pytest.raises(PlanError, match=r"n_heads=8 is not divisible by tp=3.*Fix: use tp in \[1, 2, 4, 8\]"):
        check(meta_llama(), dict(tp=3), [TensorParallel()])


def test_kv_heads_not_divisible_by_tp():
    with pytest.raises(PlanError, match="n_kv_heads=2 is not divisible by tp=4"):
        check(meta_llama(n_kv_heads=2), dict(tp=4), [TensorParallel()])


def test_vocab_not_divisible_by_tp_names_the_padding_fix():
    with pytest.raises(PlanError, match=r"vocab_size=250 is not divisible by tp=4.*vocab_size=252"):
        check(meta_llama(vocab_size=250), dict(tp=4), [TensorParallel()])


def test_sequence_parallel_without_tensor_parallel():
    with pytest.raises(PlanError, match=r"SequenceParallel requires 'tensor_parallel@tp'"):
        check(meta_llama(), dict(tp=2), [SequenceParallel()])


def test_sequence_parallel_before_tensor_parallel_says_to_move_it():
    with pytest.raises(PlanError, match="move TensorParallel before SequenceParallel"):
        check(meta_llama(), dict(tp=2), [SequenceParallel(), TensorParallel()])


def test_data_parallel_before_tensor_parallel():
    with pytest.raises(PlanError, match=r"out of order: DataParallel must run after TensorParallel"):
        check(meta_llama(), dict(tp=2, dp_shard=2), [DataParallel(), TensorParallel()])


def test_rule_that_matches_nothing_is_named():
    rule = Rule("layers.*.attention.w_query", "colwise")
    with pytest.raises(PlanError, match=r"Rule\('layers.\*.attention.w_query', 'colwise'\) match no module"):
        check(meta_llama(), dict(tp=2), [TensorParallel(rules=[rule])])


def test_unknown_style_and_wrong_owner():
    with pytest.raises(PlanError, match="unknown style 'diagonal'"):
        check(meta_llama(), dict(tp=2), [TensorParallel(rules=[("output", "diagonal")])])
    with pytest.raises(PlanError, match="style 'sequence_norm' belongs to sequence_parallel"):
        check(meta_llama(), dict(tp=2), [TensorParallel(rules=[("norm", "sequence_norm")])])


def test_mesh_axis_without_a_pass():
    with pytest.raises(PlanError, match=r"mesh axis 'dp_shard' has size 2 but no pass.*DataParallel"):
        check(meta_llama(), dict(tp=2, dp_shard=2), [TensorParallel()])


def test_pass_on_a_missing_axis():
    with pytest.raises(PlanError, match="uses mesh axis 'model'"):
        check(meta_llama(), dict(), [TensorParallel(axis="model")])


def test_fsdp_with_replicas_and_hsdp_without():
    with pytest.raises(PlanError, match="mode='hsdp'"):
        check(meta_llama(), dict(dp_replicate=2, dp_shard=2), [DataParallel("fsdp")])
    with pytest.raises(PlanError, match="needs dp_replicate > 1"):
        check(meta_llama(), dict(dp_shard=2), [DataParallel("hsdp")])


def test_bad_pass_options():
    with pytest.raises(PlanError, match="mode='zero4'"):
        DataParallel("zero4")
    with pytest.raises(PlanError, match="every=0"):
        check(meta_llama(), dict(), [Recompute(every=0)])
    with pytest.raises(PlanError, match="policy='some'"):
        check(meta_llama(), dict(), [Recompute(policy="some")])


def test_selective_recompute_without_an_attention_module():
    from tests.interop_models import hf_tiny_llama

    with pytest.raises(PlanError, match="computes attention in a function.*policy='full'"):
        check(hf_tiny_llama(), dict(), [Recompute("selective")])


def test_duplicate_passes():
    with pytest.raises(PlanError, match="both provide 'tensor_parallel@tp'"):
        check(meta_llama(), dict(tp=2), [TensorParallel(), TensorParallel()])


def test_unknown_model_without_rules():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(PlanError, match="no built-in rule set knows Sequential"):
        check(model, dict(tp=2), [TensorParallel()])


def test_world_size_not_the_mesh_product():
    with pytest.raises(PlanError, match=r"has 8 ranks but the world has 4"):
        resolve_mesh_sizes(4, pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=4)
    with pytest.raises(PlanError, match="does not divide the world size 6"):
        resolve_mesh_sizes(6, pp=1, dp_replicate=1, dp_shard=-1, cp=1, tp=4)
    assert resolve_mesh_sizes(8, pp=1, dp_replicate=1, dp_shard=-1, cp=1, tp=2)["dp_shard"] == 4


def test_expert_parallelism_larger_than_the_ranks_it_can_borrow():
    with pytest.raises(PlanError, match=r"ep=2: expert parallelism borrows its ranks from data parallelism, but the "
                                        r"world of 1 ranks has 1 data-parallel ranks"):
        dtmega.make_mesh(ep=2)
    with pytest.raises(PlanError, match=r"ep=4: .* has 2 data-parallel ranks \(world / \(pp x cp x tp\) = 8 / 4\)"):
        resolve_mesh_sizes(8, pp=1, dp_replicate=1, dp_shard=-1, ep=4, cp=1, tp=4)
    assert resolve_mesh_sizes(8, pp=1, dp_replicate=1, dp_shard=-1, ep=2, cp=1, tp=2)["dp_shard"] == 2


def test_errors_leave_the_model_untouched():
    model = meta_llama()
    before = {name: (type(p), p.shape) for name, p in model.named_parameters()}
    with pytest.raises(PlanError):
        check(model, dict(tp=2, dp_shard=2), [DataParallel(), TensorParallel()])
    assert {name: (type(p), p.shape) for name, p in model.named_parameters()} == before


def test_a_mesh_shape_names_only_the_axes_it_uses():
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("llama3-8b"))
    layout = dtmega.check_plan(model, {"tp": 8, "dp_shard": 64}, Plan([TensorParallel(), DataParallel("fsdp")]))
    assert layout.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 64, "ep": 1, "cp": 1, "tp": 8}
    with pytest.raises(PlanError, match="mesh axis tp=0 must be a positive integer"):
        dtmega.check_plan(model, {"tp": 0}, Plan([TensorParallel()]))


def test_an_axis_one_pass_splits_the_model_over_and_another_the_batch_over_is_refused():
    """A researcher's pass that shards the embedding over dp_shard next to DataParallel (which
    splits the batch over dp_shard): refused, naming the axis and both passes. Alone, the pass
    owns dp_shard and the batch is not split over it."""
    from tests.user_passes import EmbeddingOverAxis

    with pytest.raises(PlanError, match=r"mesh axis 'dp_shard' is used two ways: EmbeddingOverAxis splits the model "
                                        r"over it.*DataParallel splits the batch.*Fix: give EmbeddingOverAxis a mesh axis"):
        check(meta_llama(), dict(dp_shard=2), [EmbeddingOverAxis(), DataParallel("fsdp")])
    with pytest.raises(PlanError, match=r"mesh axis 'cp' is used two ways.*ContextParallel splits each sequence"):
        from dtmega.passes import ContextParallel

        check(meta_llama(), dict(cp=2), [EmbeddingOverAxis(axis="cp"), ContextParallel(), DataParallel("fsdp")])
    alone = check(meta_llama(), dict(dp_shard=2), [EmbeddingOverAxis()])
    assert alone.batch_axes == () and alone.axis_uses["dp_shard"] == {"EmbeddingOverAxis": "model"}
    standard = check(meta_llama(), dict(dp_shard=2, ep=1, tp=2), [TensorParallel(), DataParallel("fsdp")])
    assert standard.batch_axes == ("dp_shard",) and standard.axis_uses["tp"] == {"TensorParallel": "model"}
    assert dtmega.passes.Layout.from_toml(standard.to_toml()).axis_uses == standard.axis_uses
