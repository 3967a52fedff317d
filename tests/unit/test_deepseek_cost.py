"""The cost model for DeepSeek-V3 (issue 35 item 4): the flex dispatcher's rows follow the
ranks a token's experts lie on (group-limited routing bounds them: V3's 8 groups on 8 EP ranks,
top-4 groups, give 4 rows per token where the all-to-all dispatcher sends 8), checked against
a Monte-Carlo deal; multi-token prediction adds its block's parameters, activations and logits
to the last pipeline rank and its embeddings to each stage-to-stage send; `dtmega plan` tries
both dispatchers and writes `--moe-token-dispatcher-type flex` for the flex plans."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dtmega.cli import main
from dtmega.cost.comm import collectives
from dtmega.cost.memory import memory
from dtmega.cost.plan_cli import model_shape_for
from dtmega.cost.shapes import ModelShape, PlanShape


def _sampled_ranks(experts: int, ep: int, top_k: int, groups: int | None, group_topk: int | None,
                   draws: int = 20000) -> float:
    """Monte-Carlo with DeepSeek-V3's router on uniform random scores: groups ranked by the sum
    of their two best scores, the top-k experts within the best `group_topk` groups; the
    distinct EP ranks they lie on (consecutive experts per group and per rank)."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(draws, experts, generator=generator)
    if groups:
        group_scores = scores.view(draws, groups, experts // groups).topk(2, dim=-1).values.sum(-1)
        chosen = group_scores.topk(group_topk, dim=-1).indices
        allowed = torch.zeros(draws, groups, dtype=torch.bool).scatter_(1, chosen, True)
        scores = scores.masked_fill(~allowed.repeat_interleave(experts // groups, dim=1), -1.0)
    picked = scores.topk(top_k, dim=-1).indices // (experts // ep)
    return float(torch.tensor([len(set(row.tolist())) for row in picked]).float().mean())


@pytest.mark.parametrize("experts, ep, top_k, groups, group_topk", [
    (8, 4, 2, None, None), (8, 4, 2, 4, 1), (256, 8, 8, 8, 4), (256, 64, 8, 8, 4), (256, 4, 8, 8, 4),
    (64, 16, 6, None, None), (64, 16, 6, 8, 3)])
def test_ranks_per_token_matches_a_sampled_deal(experts, ep, top_k, groups, group_topk):
    """Within 7 %: the closed form takes the experts of the chosen groups as equally likely,
    while DeepSeek's group score (its two best experts) makes each chosen group a little
    likelier to hold one of the top-k (the sampled deal: 3.95 rows where the form says 4 for
    V3 on EP8; 4.53 against 4.27 for 64 experts in 8 groups on EP16)."""
    shape = ModelShape(64, 2, 4, 4, 128, 256, False, experts=experts, top_k=top_k, expert_ffn=32, moe_layers=2,
                       groups=groups, group_topk=group_topk)
    assert shape.ranks_per_token(ep) == pytest.approx(_sampled_ranks(experts, ep, top_k, groups, group_topk), rel=0.07)


def test_flex_sends_half_the_expert_bytes_for_deepseek_v3_on_8_ranks():
    """V3's device-limited routing: 8 groups on EP8, each token's experts in its best 4 groups,
    so the flex dispatcher sends 4 rows per token where the all-to-all sends 8."""
    v3 = model_shape_for("deepseek-v3")
    assert (v3.groups, v3.group_topk) == (8, 4) and v3.ranks_per_token(8) == 4.0

    def ep_bytes(dispatcher: str) -> float:
        plan = PlanShape(dp=64, ep=8, dispatcher=dispatcher, dtype="bfloat16")
        return sum(c.tensor_bytes for c in collectives(v3, plan, 4096) if c.axis == "ep")
    assert ep_bytes("flex") / ep_bytes("alltoall") == pytest.approx(0.5, rel=0.01)


def test_multi_token_prediction_costs_the_last_rank_its_block_and_the_sends_their_embeddings():
    v3 = model_shape_for("deepseek-v3")
    without = dataclasses.replace(v3, mtp_layers=0)
    one_stage = PlanShape(dp=64, ep=8, dtype="bfloat16")  # the last rank is the only one
    assert memory(v3, one_stage, 4096).activations > memory(without, one_stage, 4096).activations
    assert memory(v3, one_stage, 4096).weights > memory(without, one_stage, 4096).weights
    plan = PlanShape(pp=4, dp=16, ep=8, dtype="bfloat16", microbatches=8)

    def sent(shape: ModelShape) -> float:
        return sum(c.tensor_bytes for c in collectives(shape, plan, 4096) if c.kind == "send")
    assert sent(v3) == pytest.approx(2 * sent(without))  # the hidden states and one depth's embeddings


def test_plan_tries_the_flex_dispatcher_and_writes_its_flag(capsys):
    """`dtmega plan` ranks flex plans beside all-to-all ones (--compare names one), and a flex
    plan's launch line asks for the flex dispatcher."""
    from dtmega.cost.plan_flags import as_flags, train_options
    from dtmega.cost.search import RunWorkload

    assert main(["plan", "--model", "deepseek-v3", "--gpus", "256", "--gpus-per-node", "8", "--gpu", "h100",
                 "--seq-length", "4096", "--top", "40", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["dispatcher"] for row in rows} == {"alltoall", "flex"}
    assert main(["plan", "--model", "deepseek-v3", "--gpus", "256", "--gpus-per-node", "8", "--gpu", "h100",
                 "--seq-length", "4096", "--compare", "tp=1,pp=1,cp=1,ep=8,mb=1,recompute=full,dispatcher=flex"]) == 0
    assert "compare tp=1,pp=1,cp=1,ep=8,mb=1,recompute=full,dispatcher=flex: TP1 FSDP256 EP8(flex)" in \
        capsys.readouterr().out
    flags = as_flags(train_options(PlanShape(dp=64, ep=8, dispatcher="flex"), model_shape_for("deepseek-v3"),
                                   RunWorkload(seq=4096, global_batch=64)))
    assert "--moe-token-dispatcher-type flex" in flags
