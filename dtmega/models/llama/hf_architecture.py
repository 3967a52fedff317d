"""Hugging Face's LlamaForCausalLM and MixtralForCausalLM as dtmega's Llama family (one entry:
both read into a LlamaConfig; a config with experts is written as Mixtral)."""

from __future__ import annotations

from dtmega.models.family import HFArchitecture
from dtmega.models.llama.hf_config import ARCHITECTURES, hf_config_from_llama, llama_config_from_hf
from dtmega.models.llama.hf_names import hf_source, hf_tensors


def _harmless(name: str, config) -> bool:
    """Older checkpoints' RoPE tables; a tied model's lm_head."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_embeddings)


LLAMA_HF = HFArchitecture(
    names=tuple(ARCHITECTURES), model="llama", family="dtmega-llama", config_from_hf=llama_config_from_hf,
    hf_config=hf_config_from_llama, source=lambda name, config, names, hf: hf_source(name, config, names),
    tensors=hf_tensors, harmless=_harmless,
)
