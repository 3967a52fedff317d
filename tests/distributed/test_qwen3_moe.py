"""Qwen3-MoE (dtmega/models/qwen3_moe/) under every plan against the unsharded Qwen3-MoE: loss
(the auxiliary load-balancing loss included; per sequence under PP, whose micro-batches
are not the batch), every gradient, 5 AdamW steps, at the suite's fp32
tolerances (tests/helpers.py: 1e-5 relative, fp32 sums in another order). The size is
`qwen3-moe-debug`: Qwen3's attention in small (q/k norms, head_dim 32 with 4 heads on a width of
64) with 8 experts of width 32, top-2, normalized top-k weights, in both blocks.

Expert parallelism alone and with TP (experts split on their hidden dim: Megatron's expert tensor
parallelism), context parallelism by each method, pipeline stages, FSDP2, recompute and compiled
fused blocks; packed documents equal each document run alone.
"""

from __future__ import annotations

import dataclasses

import pytest

import dtmega
from dtmega.models.qwen3_moe import QWEN3_MOE_SIZES, Qwen3Moe
from dtmega.passes import (
    Compile,
    ContextParallel,
    DataParallel,
    DocumentMasking,
    ExpertParallel,
    FuseKernels,
    PipelineSplit,
    Recompute,
    SequenceParallel,
    TensorParallel,
)
from tests.distributed.test_qwen3 import _load_norms
from tests.distributed.test_qwen3 import build as build_qwen3
from tests.helpers import assert_close_to_reference, compare_training, first_copy_mesh

PLANS = {
    "tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel()]),
    "ep2": (dict(ep=2), [ExpertParallel(), DataParallel("ddp")]),
    "ep2_tp2_sp": (dict(ep=2, tp=2), [TensorParallel(), SequenceParallel(), ExpertParallel(), DataParallel("fsdp")]),
    "cp2_ring": (dict(cp=2), [ContextParallel(method="ring"), DataParallel("ddp")]),
    "cp2_all_gather": (dict(cp=2), [ContextParallel(method="all_gather"), DataParallel("ddp")]),
    "cp2_a2a": (dict(cp=2), [ContextParallel(method="a2a"), DataParallel("ddp")]),
    "pp2": (dict(pp=2), [PipelineSplit(microbatches=2), DataParallel("ddp")]),
    "fsdp2": (dict(dp_shard=2), [DataParallel("fsdp")]),
    "recompute_full_ep2_fsdp2": (dict(ep=2, dp_shard=2), [ExpertParallel(), Recompute("full"), DataParallel("fsdp")]),
    "compiled_fused_tp2_sp_fsdp2": (dict(tp=2, dp_shard=2), [TensorParallel(), SequenceParallel(), FuseKernels(),
                                                             DataParallel("fsdp"), Compile("aot_eager")]),
}


def build(seed: int, **moe):
    """The materialized unsharded reference (random norms), and a factory of meta copies; `moe`
    changes the router's settings."""
    config = QWEN3_MOE_SIZES["qwen3-moe-debug"]
    config = config.replace(moe=dataclasses.replace(config.moe, **moe))
    return (config, *build_qwen3(config, seed, Qwen3Moe))


@pytest.mark.parametrize("name", list(PLANS))
def test_qwen3_moe_plan_matches_unsharded(name):
    sizes, passes = PLANS[name]
    # pipelining cuts the batch into micro-batches and the batch-wide balancing loss is one micro-batch's
    # by definition (Megatron's too): under PP the per-sequence loss, the same whatever the cut
    _, reference, meta_copy = build(seed=61, **({"load_balancing": "seq_aux_loss"} if "pp" in sizes else {}))
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(**sizes), dtmega.Plan(passes))
    pm.init_weights(seed=61)
    _load_norms(pm, reference)
    batch = 8 if "pp" in sizes else 4
    assert_close_to_reference(compare_training(reference, pm, steps=5, batch_size=batch, seq_len=32))


def test_qwen3_moe_packed_documents_equal_each_document_alone():
    from tests.distributed.test_document_masking import train_against_each_document_alone

    # each document alone has its own routing statistics: no balancing loss (a statistic of the batch)
    config, reference, meta_copy = build(seed=62, aux_loss_coeff=0.0)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(ep=2, cp=2),
                            [DocumentMasking(), ContextParallel(method="a2a"), ExpertParallel(), DataParallel("fsdp")])
    pm.init_weights(seed=62)
    _load_norms(pm, reference)
    train_against_each_document_alone(pm, reference, lambda tokens: reference(tokens), config.vocab_size, steps=3)
