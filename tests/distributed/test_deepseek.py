"""dtmega's DeepSeek-V3 family (MLA, group-limited sigmoid routing with an expert bias, shared
experts, a dense first block) under the plans, against the unsharded model: loss including the
balancing loss, every gradient, 5 AdamW steps (fp32, the suite's 1e-5 tolerances). Expert
parallelism with groups mapped onto EP ranks: each token's experts lie on at most
group_topk ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dtmega
from dtmega.models.deepseek import DeepSeek, DeepSeekConfig
from dtmega.models.deepseek.mtp_runtime import MTPRuntime
from dtmega.models.moe import moe_layers
from dtmega.passes import (
    Compile,
    ContextParallel,
    DataParallel,
    ExpertParallel,
    FuseKernels,
    PipelineSplit,
    Recompute,
    SequenceParallel,
    TensorParallel,
)
from dtmega.passes.expert_parallel import ExpertDispatch
from tests.helpers import assert_close_to_reference, compare_training, first_copy_mesh


def debug_config(mtp: int = 0, **moe) -> DeepSeekConfig:
    """deepseek-debug (8 experts in 4 groups, top-2 from the best 2 groups) with a per-sequence
    balancing loss, so every plan also checks how the loss's statistics are summed; `mtp`
    multi-token-prediction depths."""
    config = DeepSeekConfig.from_name("deepseek-debug", mtp_num_layers=mtp, mtp_loss_scaling_factor=0.3)
    return config.replace(moe=dataclasses.replace(config.moe, **{"load_balancing": "seq_aux_loss",
                                                                 "aux_loss_coeff": 1e-2, **moe}))


def build(config: DeepSeekConfig, seed: int):
    with torch.device("meta"):
        reference = DeepSeek(config)
    reference.to_empty(device="cpu")
    reference.init_weights(seed=seed)

    def meta_copy():
        with torch.device("meta"):
            return DeepSeek(config)

    return reference, meta_copy


PLANS = {
    "tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel()]),
    "ep4_groups": (dict(ep=4), [ExpertParallel(), DataParallel("fsdp")]),
    "ep4_groups_flex": (dict(ep=4), [ExpertParallel(dispatcher="flex"), DataParallel("fsdp")]),
    "fsdp2": (dict(dp_shard=2), [DataParallel("fsdp")]),
    "cp2_ring": (dict(cp=2), [ContextParallel(method="ring"), DataParallel("fsdp")]),
    "cp2_all_gather": (dict(cp=2), [ContextParallel(method="all_gather"), DataParallel("fsdp")]),
    "cp2_a2a": (dict(cp=2), [ContextParallel(method="a2a"), DataParallel("fsdp")]),
    "full_recompute_fsdp2": (dict(dp_shard=2), [Recompute("full"), DataParallel("fsdp")]),
    "compiled_fused": (dict(), [FuseKernels(), Compile("aot_eager")]),
    "fused_tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel(), FuseKernels()]),
    "pp2": (dict(pp=2), [PipelineSplit(microbatches=2), DataParallel("ddp")]),
    "pp2_tp2_sp": (dict(pp=2, tp=2), [TensorParallel(), SequenceParallel(), PipelineSplit(microbatches=2)]),
    "selective_recompute_tp2": (dict(tp=2), [TensorParallel(), SequenceParallel(), Recompute("selective")]),
}


MTP_PLANS = {
    "mtp_fsdp2": (dict(dp_shard=2), [DataParallel("fsdp")]),
    "mtp_ep2_fsdp2": (dict(ep=2, dp_shard=2), [ExpertParallel(dispatcher="flex"), DataParallel("fsdp")]),
}


@pytest.mark.parametrize("name", list(MTP_PLANS))
def test_multi_token_prediction_matches_unsharded(name):
    """Two MTP depths (each depth's loss averaged over the global batch's kept positions, as the
    next-token loss): loss with the MTP loss, every gradient (the MTP modules' included: their
    block is an MoE block, whose experts EP shards too), 5 AdamW steps."""
    sizes, passes = MTP_PLANS[name]
    reference, meta_copy = build(debug_config(mtp=2), seed=44)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(**sizes), dtmega.Plan(passes))
    pm.init_weights(seed=44)
    assert pm.hook(MTPRuntime) is not None
    assert_close_to_reference(compare_training(reference, pm, steps=5, seq_len=16))
    assert float(pm.hook(MTPRuntime).last_loss) > 0
    if "fused" in name:  # the family's fusion sites, MTP's included: MLA's RoPE, latent norms, SwiGLU, residual norms
        fused = {fqn: entry.kernel.rpartition(".")[0] for fqn, entry in pm.layout.modules.items() if entry.kernel}
        assert fused["layers.0.attention.rotary"] == fused["mtp.0.block.attention.rotary"] == "rope"
        assert fused["layers.0.attention.kv_norm"] == fused["mtp.0.enorm"] == "rms_norm"
        assert fused["layers.0.feed_forward.act"] == "swiglu" and fused["layers.1.ffn_norm"] == "rms_norm_residual"


@pytest.mark.parametrize("name", list(PLANS))
def test_deepseek_plans_match_unsharded(name):
    """Every plan with one MTP depth (its loss in the total, its modules' gradients checked):
    under PP2 the MTP module sits on the last stage, the embedding of the tokens ahead comes
    from the first stage with the hidden states."""
    sizes, passes = PLANS[name]
    reference, meta_copy = build(debug_config(mtp=1), seed=41)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(**sizes), dtmega.Plan(passes))
    pm.init_weights(seed=41)
    assert_close_to_reference(compare_training(reference, pm, steps=5, seq_len=16))
    assert float(pm.hook(MTPRuntime).last_loss) > 0
    if "fused" in name:  # the family's fusion sites, MTP's included: MLA's RoPE, latent norms, SwiGLU, residual norms
        fused = {fqn: entry.kernel.rpartition(".")[0] for fqn, entry in pm.layout.modules.items() if entry.kernel}
        assert fused["layers.0.attention.rotary"] == fused["mtp.0.block.attention.rotary"] == "rope"
        assert fused["layers.0.attention.kv_norm"] == fused["mtp.0.enorm"] == "rms_norm"
        assert fused["layers.0.feed_forward.act"] == "swiglu" and fused["layers.1.ffn_norm"] == "rms_norm_residual"


def test_group_limited_routing_bounds_the_ranks_a_token_reaches():
    """EP4 holds one group of 2 experts per rank: with group_topk=2 a token's top-2 experts lie
    on at most 2 ranks, whatever the scores."""
    reference, _ = build(debug_config(), seed=42)
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3))
    chosen = []
    for _, layer in moe_layers(reference):
        layer.register_forward_hook(lambda module, args, out: chosen.append(
            module.router(args[0].reshape(-1, args[0].shape[-1]), 4, 16).ids))
    with torch.no_grad():
        reference(tokens)
    experts_per_rank = 8 // 4
    for ids in chosen:
        assert max(len(set(row)) for row in (ids // experts_per_rank).tolist()) <= 2


def dispatch_bytes(config: DeepSeekConfig, dispatcher: str) -> int:
    """Bytes this rank sent moving tokens for one forward and backward under EP4."""
    _, meta_copy = build(config, seed=43)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(ep=4), dtmega.Plan([ExpertParallel(dispatcher=dispatcher),
                                                                             DataParallel("fsdp")]))
    pm.init_weights(seed=43)
    pm.forward_backward(pm.shard_batch(dtmega.synthetic_batch(8, 32, config.vocab_size, seed=5)))
    return pm.hook(ExpertDispatch).comm.bytes_sent


def test_the_flex_dispatch_sends_each_token_once_per_rank_so_groups_cut_its_bytes():
    """16 experts (4 per EP rank = one group), top-4: ungrouped, a token's experts may lie on all
    4 ranks; with group_topk=2 on at most 2. The flex dispatcher sends one row per token and rank,
    so its bytes fall with the groups; the all-to-all one sends one row per expert either way."""
    wide = dict(num_experts=16, top_k=4, num_groups=4, group_topk=2)
    grouped = debug_config(**wide)
    ungrouped = debug_config(**{**wide, "num_groups": None, "group_topk": None})
    flex_grouped, flex_ungrouped = dispatch_bytes(grouped, "flex"), dispatch_bytes(ungrouped, "flex")
    per_expert = dispatch_bytes(grouped, "alltoall")
    assert flex_grouped < 0.8 * flex_ungrouped and flex_grouped < 0.7 * per_expert, (flex_grouped, flex_ungrouped,
                                                                                     per_expert)


def test_dtmega_train_deepseek_debug_with_expert_parallelism_and_mtp(shared_dir):
    """Issue 35's launch on 4 CPU ranks, docs/deepseek.md's own command line: --model
    deepseek-debug, EP4 with the flex dispatcher and one MTP depth; the loss falls and both
    losses are logged (mtp_loss beside loss)."""
    import json
    import shlex

    from tests.doc_blocks import ROOT, collect_blocks, commands
    from tests.train_helpers import train_reusing_meshes

    log = shared_dir / "deepseek_metrics.jsonl"
    block = next(b for b in collect_blocks([ROOT / "docs" / "deepseek.md"]) if "dtmega train" in b.code)
    launch = shlex.split(commands(block.code)[0])
    argv = launch[launch.index("train") + 1:] + ["--log-interval", "1", "--seed", "5", "--log-file", str(log)]
    assert launch[:3] == ["torchrun", "--nproc-per-node", "4"] and "--mtp-num-layers" in argv
    result = train_reusing_meshes(argv)
    assert result.losses[-1] < result.losses[0], result.losses
    if torch.distributed.get_rank() == 0:
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        assert all(row["mtp_loss"] > 0 for row in rows) and len(rows) == 16
