"""The GPT family (dtmega/models/gpt/) under every plan against the unsharded GPT, **with dropout
on**: loss, every gradient, 5 AdamW steps, at the suite's fp32 tolerances (tests/helpers.py: 1e-5
relative, fp32 sums in another order). Dropout masks are functions of each token's global sample
and position (dtmega/models/gpt/dropout.py), so a plan that splits heads, sequences, stages or
samples draws exactly the masks the unsharded model draws, and recompute replays them.

The size is `gpt-debug` (LayerNorm, learned positions, biases, a GeLU MLP, the output tied to the
word embedding) with dropout 0.1 on attention probabilities and the residual branches, and random
LayerNorm weights and biases (they start at one and zero, where a missing gradient sum or a bias
added twice would change nothing). Pipeline plans keep the embedding tied: the first stage holds
it, the last a copy, their gradients summed over the embedding group (passes/tied_embeddings.py).
Context parallelism keeps hidden dropout; attention dropout with CP is refused by name (its
attention kernels compute none), which the last test holds.
"""

from __future__ import annotations

import pytest
import torch

import dtmega
from dtmega.models.gpt import GPT, GPT_SIZES
from dtmega.models.moe_config import MoEConfig
from dtmega.passes import (
    Compile,
    ContextParallel,
    DataParallel,
    ExpertParallel,
    PipelineSplit,
    PlanError,
    Recompute,
    SequenceParallel,
    TensorParallel,
)
from tests.helpers import compare_training, first_copy_mesh

PLANS = {
    "tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel()]),
    # --qk-layernorm on GPT blocks: a LayerNorm (weight and bias) on each query and key head, whose
    # gradients TP sums over the ranks holding other heads (head_norm)
    "qknorm_tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel()]),
    "qknorm_tp2_fsdp2": (dict(tp=2, dp_shard=2), [TensorParallel(), DataParallel("fsdp")]),
    # --rotary-percent 0.5 with RoPE: each head's first half rotated, the rest passed through
    "halfrope_cp2_ring": (dict(cp=2), [ContextParallel(method="ring"), DataParallel("ddp")]),
    "halfrope_tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel()]),
    "cp2_ring": (dict(cp=2), [ContextParallel(method="ring"), DataParallel("ddp")]),
    "cp2_all_gather": (dict(cp=2), [ContextParallel(method="all_gather"), DataParallel("ddp")]),
    "pp2_tied": (dict(pp=2), [PipelineSplit(microbatches=2), DataParallel("ddp")]),
    "pp2_tp2_tied": (dict(pp=2, tp=2), [TensorParallel(), PipelineSplit(microbatches=2), DataParallel("ddp")]),
    "fsdp2": (dict(dp_shard=2), [DataParallel("fsdp")]),
    "fsdp4": (dict(dp_shard=4), [DataParallel("fsdp")]),
    "recompute_full_tp2_sp_fsdp2": (dict(tp=2, dp_shard=2), [TensorParallel(), SequenceParallel(), Recompute("full"),
                                                             DataParallel("fsdp")]),
    "recompute_selective_tp2_ddp2": (dict(tp=2, dp_replicate=2), [TensorParallel(), Recompute("selective"),
                                                                  DataParallel("ddp")]),
    "compiled_tp2_sp_fsdp2": (dict(tp=2, dp_shard=2), [TensorParallel(), SequenceParallel(), DataParallel("fsdp"),
                                                       Compile("aot_eager")]),
}


# Mixture-of-experts GPT blocks (Megatron's GPT MoE: GeLU experts without biases, erf GeLU) with
# dropout, under expert parallelism: the auxiliary-loss router, and Sinkhorn top-1 routing, whose
# balancing runs over the whole micro-batch (column sums all-reduced over the ranks holding it)
MOE = {"aux": MoEConfig(num_experts=4, top_k=2, ffn_dim=48, activation="gelu", aux_loss_coeff=1e-2),
       "sinkhorn": MoEConfig(num_experts=4, top_k=1, ffn_dim=48, activation="gelu", load_balancing="sinkhorn",
                             aux_loss_coeff=0.0)}
MOE_PLANS = {
    "ep2_fsdp2": (dict(dp_shard=2, ep=2), [ExpertParallel(dispatcher="alltoall"), DataParallel("fsdp")]),
    "ep2_tp2_sp": (dict(tp=2, ep=2), [TensorParallel(), SequenceParallel(), ExpertParallel(dispatcher="allgather"),
                                      DataParallel("fsdp")]),
    # Megatron's MoE parallel folding with expert tensor parallelism 1: experts whole, spread over
    # ep x tp (one per rank), each TP rank sending its share of the tokens (kernels/moe_fold.py)
    "ep2_tp2_sp_etp1": (dict(tp=2, ep=2), [TensorParallel(expert_hidden=False), SequenceParallel(),
                                           ExpertParallel(dispatcher="alltoall", fold=("tp",)), DataParallel("fsdp")]),
    "tp2_sp_fsdp2_etp1": (dict(tp=2, dp_shard=2), [TensorParallel(expert_hidden=False), SequenceParallel(),
                                                   ExpertParallel(dispatcher="alltoall", fold=("tp",)),
                                                   DataParallel("fsdp")]),
}


def gpt_config(cp: bool = False, moe: MoEConfig | None = None, qk_norm: bool = False, half_rope: bool = False):
    rope = dict(position_embedding="rope", rotary_percent=0.5) if half_rope else {}
    return GPT_SIZES["gpt-debug"].replace(attention_dropout=0.0 if cp else 0.1, hidden_dropout=0.1, moe=moe,
                                          qk_norm=qk_norm, **rope)


def build(config, seed: int):
    """The materialized unsharded reference (random norm weights and biases), and a factory of
    meta copies to shard."""
    with torch.device("meta"):
        reference = GPT(config)
    reference.to_empty(device="cpu")
    reference.init_weights(seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.ndim == 1:
                param.copy_(torch.rand(param.shape, generator=generator) * 0.5 + (0.75 if "norm" in name else -0.25))

    def meta_copy():
        with torch.device("meta"):
            return GPT(config)

    return reference, meta_copy


def _load_vectors(pm, reference) -> None:
    """The reference's norm weights and biases into the plan's (sharded or replicated) parameters."""
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in pm.named_parameters():
            if param.ndim == 1:
                source = params[name].detach()
                if isinstance(param, torch.distributed.tensor.DTensor):
                    source = torch.distributed.tensor.distribute_tensor(source, param.device_mesh, param.placements,
                                                                        src_data_rank=None)
                param.copy_(source)


# float64: every plan equals the unsharded model up to float64 roundoff. In fp32 the query bias's
# gradient (a sum over positions that nearly cancels) differs by 2e-5 under context parallelism's
# online softmax, above the suite's 1e-5, with the plan exact (1e-15 in float64): float64 tells a
# wrong plan from roundoff where fp32 cannot here. 1e-7, not 1e-12: a pipeline's step scales each
# micro-batch's loss by an fp32 scalar (ranks / global tokens, ParallelModel._step), 1e-8 apart
# from the unsharded model's float64 mean.
RTOL = 1e-7
# parameters after 5 AdamW steps: Adam divides each entry by its gradient's running magnitude, so
# roundoff in entries near zero grows into the update (dtmega.testing.compare_training)
PARAM_RTOL = 1e-7


@pytest.mark.parametrize("name", [*PLANS, *(f"moe_{router}_{plan}" for router in MOE for plan in MOE_PLANS)])
def test_gpt_plan_with_dropout_matches_unsharded(name):
    moe = None
    if name.startswith("moe_"):
        _, router, plan = name.split("_", 2)
        (sizes, passes), moe = MOE_PLANS[plan], MOE[router]
    else:
        sizes, passes = PLANS[name]
    torch.set_default_dtype(torch.float64)
    try:
        config = gpt_config(cp="cp" in sizes, moe=moe, qk_norm=name.startswith("qknorm"),
                            half_rope=name.startswith("halfrope"))
        reference, meta_copy = build(config, seed=61)
        pm = dtmega.parallelize(meta_copy(), first_copy_mesh(**sizes), dtmega.Plan(passes))
        pm.init_weights(seed=61)
        _load_vectors(pm, reference)
        reference.train()
        pm.train()
        batch = 8 if "pp" in sizes else 4
        result = compare_training(reference, pm, steps=5, batch_size=batch, seq_len=32)
    finally:
        torch.set_default_dtype(torch.float32)
    assert_equal_but_key_bias(result, reference)


def assert_equal_but_key_bias(result, reference) -> None:
    """Loss, parameters and every gradient within RTOL, but the key projection's bias gradient
    (with --qk-layernorm, the key norm's bias instead: it is then the last add): adding a bias to every key adds the same q.b
    to a query's every score, which softmax cancels (learned positions: no rotation), so that
    gradient is zero up to roundoff in both models (their relative error is noise over noise).
    That it is noise is held instead: far below the query's counterpart. Under RoPE none is noise."""
    normed = any(name.endswith("attention.k_norm.bias") for name in result.grads)  # the last add on keys is the norm's
    last = "attention.k_norm.bias" if normed else "attention.wk.bias"
    # under RoPE the bias is rotated by each key's position, so no longer the same for every key: compared as the rest
    rotated = reference.config.position_embedding == "rope"
    noise = [] if rotated else [name for name in result.grads if name.endswith(last)]
    rest = {name: error for name, error in result.grads.items() if name not in noise}
    worst = max(rest, key=rest.get)
    assert rest[worst] <= RTOL, f"gradient {worst} relative error {rest[worst]:.2e} > {RTOL}"
    assert result.loss <= RTOL and result.param <= PARAM_RTOL, (result.loss, result.param)
    for name in noise:
        counterpart = name.replace("attention.wk", "attention.wq").replace("attention.k_norm", "attention.q_norm")
        key, query = reference.get_parameter(name).grad, reference.get_parameter(counterpart).grad
        assert key.norm() < 1e-7 * query.norm(), (name, float(key.norm()), float(query.norm()))


def test_attention_dropout_under_context_parallelism_is_refused_by_name():
    config = gpt_config()
    _, meta_copy = build(config, seed=62)
    with pytest.raises(PlanError, match=r"ContextParallel\(method='ring'\): 4 attention cores .* drop attention "
                                        r"probabilities in training \(p=0.1\).*Fix: --attention-dropout 0"):
        dtmega.parallelize(meta_copy(), first_copy_mesh(cp=2), [ContextParallel(method="ring"), DataParallel("ddp")])
