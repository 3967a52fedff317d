"""Tiny torchtitan and Hugging Face Llamas, built exactly as their users build them."""

from __future__ import annotations

import torch
from torch import nn


def torchtitan_debug_llama(seed: int = 0) -> nn.Module:
    """torchtitan's llama3 `debugmodel` (6 layers, dim 256, vocab 2048), with its SDPA inner
    attention: torchtitan's flex attention has no backward on CPU."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return _build_torchtitan(config, seed)


def _build_torchtitan(config, seed: int) -> nn.Module:
    """A torchtitan model from its config, initialized as torchtitan does, on the CPU."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    return model


def hf_tiny_llama(seed: int = 0, tie: bool = False) -> nn.Module:
    """A tiny `transformers.LlamaForCausalLM` (4 layers, GQA 8/4 heads, vocab 256)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
        tie_word_embeddings=tie, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def torchtitan_tiny_moe(seed: int = 0) -> nn.Module:
    """torchtitan's qwen3 MoE model class, built with torchtitan's own layer builder at a tiny
    size (2 blocks, dim 64, 8 experts top-2, vocab 256) and SDPA attention."""
    import dataclasses

    from torchtitan.models import qwen3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    base = qwen3.qwen3_configs["debugmodel_moe"](attn_backend="flex")
    rope = dataclasses.replace(base.layers[0].attention.rope, dim=16, max_seq_len=256)
    layers = qwen3._build_qwen3_moe_layers(
        n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, moe_hidden_dim=32, num_experts=8, top_k=2,
        attn_backend="flex", moe_comm_backend="standard", rope=rope,
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = dataclasses.replace(
        base, vocab_size=256, dim=64, norm=qwen3._qwen3_norm(64), layers=layers,
        tok_embeddings=dataclasses.replace(base.tok_embeddings, num_embeddings=256, embedding_dim=64),
        lm_head=dataclasses.replace(base.lm_head, in_features=64, out_features=256),
    )
    return _build_torchtitan(config, seed)


def hf_tiny_mixtral(seed: int = 0) -> nn.Module:
    """A tiny `transformers.MixtralForCausalLM` (2 layers, 8 experts top-2, vocab 256)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return MixtralForCausalLM(config).float()


def with_fp32_experts(model: nn.Module) -> nn.Module:
    """`model` (a torchtitan MoE decoder) with its `GroupedExperts` computing in fp32.

    torchtitan casts tokens and expert weights to bf16 for the grouped GEMM whatever the plan,
    so its MoE models cannot be held to fp32 tolerances as built. This instance-level patch runs
    the same math (silu(x W1^T) * x W3^T, then W2) without the casts, so the plan itself can be
    checked at fp32 tolerances; the as-built bf16 model is checked at bf16 tolerances beside it.
    """
    import types

    from torch.distributed.tensor import DTensor

    from dtmega.kernels.grouped_gemm import grouped_mm

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        counts = num_tokens_per_expert_E
        hidden = torch.nn.functional.silu(grouped_mm(x_RD, w1, counts)) * grouped_mm(x_RD, w3, counts)
        return grouped_mm(hidden, w2, counts)

    for module in model.modules():
        if type(module).__name__ == "GroupedExperts":
            module.forward = types.MethodType(forward, module)
    return model
