"""Hugging Face's LlamaForCausalLM and MixtralForCausalLM as dtmega's Llama family (one entry:
both read into a LlamaConfig; a config with experts is written as Mixtral)."""

from __future__ import annotations

from dtmega.models.family import HFArchitecture
from dtmega.models.llama.hf_config import ARCHITECTURES, hf_config_from_llama, llama_config_from_hf
from dtmega.models.llama.hf_names import hf_source, hf_tensors


def harmless_decoder_tensor(name: str, config) -> bool:
    """An HF tensor a Llama-like decoder (Llama, Mixtral, Qwen3, Qwen3-MoE) may leave unread:
    older checkpoints' RoPE tables; a tied model's lm_head (transformers writes none; some
    exporters do)."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_embeddings)


LLAMA_HF = HFArchitecture(
    names=tuple(ARCHITECTURES), model="llama", family="dtmega-llama", config_from_hf=llama_config_from_hf,
    hf_config=hf_config_from_llama, source=lambda name, config, names, hf: hf_source(name, config, names),
    tensors=hf_tensors, harmless=harmless_decoder_tensor,
)
