"""GPT blocks with a mixture of experts (issue 51 item 1): `--num-experts` without the Llama
block's flags builds Megatron's GPT MoE — GeLU (or squared-ReLU) experts with two weight
matrices and no biases (Megatron turns its fused bias-GeLU off without biases: F.gelu, the erf
form) — and Megatron's Sinkhorn router (`--moe-router-load-balancing-type sinkhorn`), which 24
of Megatron's MoE functional tests use. Before: refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtmega.kernels.errors import DtmegaError
from dtmega.models.moe_config import MoEConfig
from dtmega.models.router import Router, sinkhorn
from dtmega.train.args import ArgumentError, parse_train_args
from dtmega.train.prepare import model_of

BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48"]


def _model(argv):
    return model_of(parse_train_args(argv)[0], tokenizer_vocab=250)


def test_a_gpt_moe_line_builds_gelu_experts_without_a_gate_matrix():
    spec, config = _model(BASE)
    assert spec.family == "dtmega-gpt"
    assert (config.moe.activation, config.moe.gelu_approximate, config.moe.ffn_dim) == ("gelu", "none", 48)
    model = spec.build(config)
    experts = model.layers["0"].feed_forward.experts
    assert experts.w3 is None and tuple(experts.w1.shape) == (4, 48, 64) and tuple(experts.w2.shape) == (4, 64, 48)
    # the exact count, from the shapes alone, equals the built model's
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    active = config.num_params() - 2 * 2 * 64 * 48 * (4 - 2)  # 2 layers x 2 matrices x idle experts
    assert config.num_active_params() == active


def test_gelu_experts_compute_erf_gelu_mlps():
    spec, config = _model(BASE)
    model = spec.build(config).double()
    model.init_weights(seed=0)
    experts = model.layers["1"].feed_forward.experts
    x = torch.randn(5, 64, dtype=torch.float64)
    counts = torch.tensor([2, 0, 3, 0])
    out = experts(x, counts)
    ids = [0, 0, 2, 2, 2]
    expected = torch.stack([experts.w2[e] @ F.gelu(experts.w1[e] @ x[i]) for i, e in enumerate(ids)])
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("flags, activation, matrices", [(["--squared-relu"], "squared_relu", 2),
                                                         (["--swiglu"], "swiglu", 3)])
def test_the_experts_follow_the_blocks_activation(flags, activation, matrices):
    _, config = _model([*BASE, *flags])
    assert config.moe.activation == activation and config.moe.expert_matrices == matrices


def test_gpt_moe_trains_forward_and_backward_with_dropout():
    spec, config = _model([*BASE, "--moe-aux-loss-coeff", "1e-2"])
    model = spec.build(config)
    model.init_weights(seed=0)
    model.train()
    model(torch.randint(0, 250, (2, 16))).float().pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_experts_with_biases_are_refused_by_name():
    line = [flag for flag in BASE if flag != "--disable-bias-linear"]
    with pytest.raises(ArgumentError, match=r"--num-experts with biases .* Fix: add --disable-bias-linear"):
        _model(line)


# ---- Sinkhorn routing -------------------------------------------------------------------------
def _megatron_sinkhorn(logits: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """The formula of Megatron's moe_utils.sinkhorn, written out here for one rank's tokens."""
    cost = torch.exp(logits)
    d0 = torch.ones(cost.shape[0], dtype=cost.dtype)
    d1 = torch.ones(cost.shape[1], dtype=cost.dtype)
    error, previous = 1e9, d1
    while error > tol:
        d0 = (1 / d0.shape[0]) / ((d1 * cost).sum(1) + 1e-8)
        d1 = (1 / d1.shape[0]) / ((d0[:, None] * cost).sum(0) + 1e-8)
        error = (previous - d1).abs().mean()
        previous = d1
    return d1 * cost * d0[:, None]


def test_sinkhorn_balances_as_megatrons_and_spreads_the_tokens():
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    logits[:, 0] += 8  # nearly every token prefers expert 0
    balanced = sinkhorn(logits)
    torch.testing.assert_close(balanced, _megatron_sinkhorn(logits), rtol=1e-12, atol=0)
    torch.testing.assert_close(balanced.sum(0), torch.full((8,), 1 / 8, dtype=torch.float64), rtol=1e-3, atol=0)
    assert torch.bincount(logits.argmax(1), minlength=8)[0] > 50  # unbalanced by score
    assert torch.bincount(balanced.argmax(1), minlength=8).max() <= 16  # about 64 / 8 each


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_sinkhorn_router_chooses_by_balance_in_training_and_weighs_by_score(top_k):
    config = MoEConfig(num_experts=4, top_k=top_k, ffn_dim=8, load_balancing="sinkhorn", aux_loss_coeff=0.0)
    router = Router(16, config).double()
    torch.nn.init.normal_(router.gate.weight, generator=torch.Generator().manual_seed(1))
    x = torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    logits = x @ router.gate.weight.T
    weights = torch.sigmoid(logits) if top_k == 1 else torch.softmax(logits, -1)
    router.train()
    routed = router(x, 2, 16)
    assert torch.equal(routed.ids, _megatron_sinkhorn(logits).topk(top_k, -1).indices)
    torch.testing.assert_close(routed.probs, weights.gather(1, routed.ids))
    router.eval()
    evaluated = router(x, 2, 16)
    assert torch.equal(evaluated.ids, weights.topk(top_k, -1).indices)


def test_sinkhorn_with_an_auxiliary_loss_is_refused():
    with pytest.raises(DtmegaError, match=r"sinkhorn routing balances the experts itself: no auxiliary loss"):
        MoEConfig(num_experts=4, top_k=1, load_balancing="sinkhorn", aux_loss_coeff=1e-2)
    with pytest.raises(ArgumentError, match="no auxiliary loss"):
        _model([*BASE, "--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "1e-2"])
