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
