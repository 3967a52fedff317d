"""A model of one's own, registered from user code (what `--custom-import tests.user_models`
loads): a tiny Hugging Face Llama, trained by `dtmega train --model hf-tiny-llama`."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

from dtmega.models import ModelSpec, register_model


def _flops_per_token(config: LlamaConfig, seq_length: int) -> float:
    """6 x the non-embedding parameters + 12 x layers x width x sequence (PaLM's accounting)."""
    d, layers = config.hidden_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * config.intermediate_size
    return 6.0 * (layers * per_layer + config.vocab_size * d) + 12.0 * layers * d * seq_length


register_model(ModelSpec(
    name="hf-tiny-llama", family="hf-llama",
    config=LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       attn_implementation="sdpa"),
    build=LlamaForCausalLM, flops_per_token=_flops_per_token,
    with_vocab=lambda config, vocab: LlamaConfig(**{**config.to_dict(), "vocab_size": vocab}),
    config_to_dict=lambda config: config.to_dict(), config_from_dict=lambda data: LlamaConfig(**data),
    materialize="seeded",  # built on the CPU under the run's seed on every rank, then sharded
), replace=True)
