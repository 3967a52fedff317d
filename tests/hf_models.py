"""Tiny Hugging Face models saved by transformers itself (random weights, fp32 safetensors),
with a small BPE tokenizer: the checkpoint tests' Llama-3.1 (RoPE scaling, GQA, untied output)
and Mixtral."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dtmega.data.tokenizers import train_bpe
from tests.corpus import make_texts

VOCAB = 320  # the tokenizer below has 300 tokens: the embedding has spare rows, as real models do


def _tokenizer(directory: Path) -> None:
    train_bpe(make_texts(60, seed=5), 300, directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))


def save_tiny_llama31(directory: Path, seed: int = 0) -> Path:
    """A 2-block LlamaForCausalLM with Llama-3.1 RoPE scaling, GQA (4 heads / 2 KV) and an
    untied output layer, in two shards with an index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, max_shard_size="100KB")
    _tokenizer(directory)
    return directory


def save_tiny_mixtral(directory: Path, seed: int = 0) -> Path:
    """A 2-block MixtralForCausalLM: 4 experts, top-2, GQA."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None, rope_parameters={"rope_type": "default",
                                                                                             "rope_theta": 10000.0},
    )
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():  # transformers initializes the router at zero: random routes test more
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(directory)
    _tokenizer(directory)
    return directory
