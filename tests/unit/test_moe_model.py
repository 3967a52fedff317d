"""The MoE model on one rank: grouped GEMM against a per-expert loop, the router's options, the
balancing losses against their formulas, the MoE layer against a token-by-token computation,
capacity dropping, configs and parameter counts."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from dtmega.kernels.grouped_gemm import expert_loop_mm, grouped_gemm_available, grouped_mm
from dtmega.models import Llama, LlamaConfig
from dtmega.models.moe import MoE
from dtmega.models.moe_config import MoEConfig
from dtmega.models.router import TokenGroups, balancing_loss
from tests.helpers import relative_error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_a_per_expert_loop(dtype):
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 9, 2, 0, 7])  # empty experts included
    x = torch.randn(int(counts.sum()), 16, generator=g).to(dtype).requires_grad_()
    w = torch.randn(6, 24, 16, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(x.shape[0], 24, generator=g).to(dtype)
    assert grouped_gemm_available(x, w)
    out = grouped_mm(x, w, counts)
    out.backward(grad)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loop = expert_loop_mm(x2, w2, counts)
    loop.backward(grad)
    # fp32: the same products summed by other kernels (roundoff ~1e-7). bf16: both sides round
    # each output to bf16 (u = 2**-8), so an entry may land one ulp (2u ~ 7.8e-3) apart.
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    for mine, theirs in ((out, loop), (x.grad, x2.grad), (w.grad, w2.grad)):
        assert relative_error(mine, theirs) <= tolerance


def test_grouped_gemm_falls_back_for_unaligned_shapes():
    x, w = torch.randn(4, 6), torch.randn(2, 5, 6)  # 6 * 4 bytes is not a multiple of 16
    assert not grouped_gemm_available(x, w)
    counts = torch.tensor([1, 3])
    assert torch.equal(grouped_mm(x, w, counts), expert_loop_mm(x, w, counts))


def moe(dim: int = 16, **options) -> MoE:
    config = MoEConfig(**{"num_experts": 4, "top_k": 2, "ffn_dim": 8, **options})
    layer = MoE(dim, config)
    torch.manual_seed(0)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    layer.router.reset_buffers(torch.device("cpu"))
    return layer


def token_by_token(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE output computed the slow, obvious way."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = layer.router(tokens, x.shape[0], x.shape[1])
    experts = layer.experts
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for k in range(routing.ids.shape[1]):
            if routing.keep is not None and not routing.keep[t, k]:
                continue
            e = routing.ids[t, k]
            h = F.silu(experts.w1[e] @ tokens[t]) * (experts.w3[e] @ tokens[t])
            out[t] += routing.probs[t, k] * (experts.w2[e] @ h)
    return out.view_as(x)


@pytest.mark.parametrize("options", [
    dict(), dict(pre_softmax=True), dict(score_func="sigmoid", route_scale=2.5), dict(capacity_factor=0.5),
    dict(capacity_factor=0.5, token_drop_policy="position"), dict(grouped_gemm=False),
], ids=["softmax", "pre_softmax", "sigmoid", "drop_probs", "drop_position", "expert_loop"])
def test_moe_layer_equals_token_by_token(options):
    layer = moe(**options).eval()
    x = torch.randn(2, 6, 16)
    assert relative_error(layer(x), token_by_token(layer, x)) <= 1e-6


def test_router_scores():
    layer = moe(num_experts=4, top_k=2)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    layer.router.gate.weight.data = torch.eye(4)
    post = layer.router(logits, 1, 1)
    assert post.ids.tolist() == [[0, 1]]
    assert torch.allclose(post.probs, torch.softmax(torch.tensor([[2.0, 1.0]]), -1))  # Mixtral's form
    layer.router.config = dataclasses.replace(layer.config, pre_softmax=True)
    assert torch.allclose(layer.router(logits, 1, 1).probs, torch.softmax(logits, -1)[:, :2])
    layer.router.config = dataclasses.replace(layer.config, score_func="sigmoid", route_scale=2.0)
    sigmoid = torch.sigmoid(logits)[:, :2]
    assert torch.allclose(layer.router(logits, 1, 1).probs, 2.0 * sigmoid / sigmoid.sum())


def test_expert_bias_changes_the_choice_not_the_weights():
    layer = moe(num_experts=4, top_k=1, expert_bias=True, score_func="sigmoid")
    layer.router.gate.weight.data = torch.eye(4)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    layer.router.expert_bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    routing = layer.router(logits, 1, 1)
    assert routing.ids.tolist() == [[3]] and torch.allclose(routing.probs, torch.sigmoid(torch.tensor([[-1.0]])))
    layer.router.update_bias(torch.tensor([10.0, 0.0, 3.0, 3.0]))  # mean 4: expert 0 over, the rest under
    assert torch.allclose(layer.router.expert_bias, torch.tensor([-1e-3, 1e-3, 1e-3, 5.0 + 1e-3]))


def test_capacity_keeps_the_best_or_the_first_tokens():
    layer = moe(num_experts=2, top_k=1, capacity_factor=1.0, pre_softmax=True)  # capacity 4 x 1 / 2 = 2 each
    layer.router.gate.weight.data = torch.eye(2, 16)
    x = torch.zeros(1, 4, 16)
    x[0, :, 0] = torch.tensor([1.0, 3.0, 2.0, 4.0])  # every token prefers expert 0, by growing margins
    keep = layer.router(x.view(4, 16), 1, 4).keep.view(-1).tolist()
    assert keep == [False, True, False, True]  # the two highest weights
    layer.router.config = dataclasses.replace(layer.config, token_drop_policy="position")
    assert layer.router(x.view(4, 16), 1, 4).keep.view(-1).tolist() == [True, True, False, False]


def test_balancing_losses_follow_their_formulas():
    config = MoEConfig(num_experts=4, top_k=2, ffn_dim=8, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    layer = moe(num_experts=4, top_k=2, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    batch, seq = 3, 5
    x = torch.randn(batch * seq, 16)
    routing = layer.router(x, batch, seq)
    chosen = torch.zeros(batch * seq, 4).scatter_(1, routing.ids, 1.0)
    scores = torch.softmax(routing.logits, -1)
    aux = 4 * ((chosen.mean(0) / 2) * scores.mean(0)).sum()
    z = torch.logsumexp(routing.logits, -1).square().mean()
    expected = 0.1 * aux + 0.01 * z
    assert torch.allclose(balancing_loss(routing, config, batch, seq, TokenGroups()), expected)
    per_seq = dataclasses.replace(config, load_balancing="seq_aux_loss", z_loss_coeff=0.0)
    f = chosen.view(batch, seq, 4).mean(1) / 2
    p = scores.view(batch, seq, 4).mean(1)
    assert torch.allclose(balancing_loss(routing, per_seq, batch, seq, TokenGroups()), 0.1 * 4 * (f * p).sum(1).mean())
    assert balancing_loss(routing, dataclasses.replace(config, load_balancing="none", z_loss_coeff=0.0), batch, seq,
                          TokenGroups()) is None


def test_the_balancing_loss_gradient_reaches_the_router():
    layer = moe(aux_loss_coeff=0.5).train()
    x = torch.randn(2, 6, 16)
    layer(x).sum().backward()
    with_aux = layer.router.gate.weight.grad.clone()
    assert float(layer.stats["loss"]) > 0
    layer.zero_grad()
    layer.reset_stats()
    explicit = layer.config.aux_loss_coeff
    layer.router.config = layer.config = dataclasses.replace(layer.config, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    out = layer(x).sum()
    routing = layer.router(x.view(12, 16), 2, 6)
    aux_config = dataclasses.replace(layer.config, aux_loss_coeff=explicit)
    (out + balancing_loss(routing, aux_config, 2, 6, TokenGroups())).backward()
    assert relative_error(with_aux, layer.router.gate.weight.grad) <= 1e-6
    assert float(layer.stats["loss"]) == 0.0 and layer.stats["routed"] == 2 * 6 * 2


def test_configs_and_parameter_counts():
    mixtral = LlamaConfig.from_name("mixtral-8x7b")
    assert mixtral.num_params() == 46_702_792_704
    assert mixtral.num_active_params() == 12_879_925_248
    with torch.device("meta"):
        model = Llama(mixtral)
    assert sum(p.numel() for p in model.parameters()) == 46_702_792_704
    deepseek = LlamaConfig.from_name("deepseek-v3-small")
    with torch.device("meta"):
        small = Llama(deepseek)
    assert type(small.layers["0"].feed_forward).__name__ == "FeedForward"
    assert all(isinstance(small.layers[str(i)].feed_forward, MoE) for i in range(1, 12))
    assert sum(p.numel() for p in small.parameters()) == deepseek.num_params()
    every_other = MoEConfig(layer_freq=2, first_dense_layers=1)
    assert [every_other.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    assert MoEConfig(num_experts=8, top_k=2, capacity_factor=1.25).capacity(100) == math.ceil(1.25 * 100 * 2 / 8)


@pytest.mark.parametrize("options, message", [
    (dict(num_experts=4, top_k=5), "top_k=5 must be between 1 and num_experts=4"),
    (dict(capacity_factor=0.0), r"capacity_factor=0.0 must be > 0"),
    (dict(capacity_factor=-1.0), r"capacity_factor=-1.0 must be > 0"),
    (dict(score_func="relu"), "score_func='relu' is not one of"),
    (dict(load_balancing="global"), "load_balancing='global' is not one of"),
    (dict(token_drop_policy="random"), "token_drop_policy='random' is not one of"),
])
def test_invalid_moe_configs(options, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**options)
