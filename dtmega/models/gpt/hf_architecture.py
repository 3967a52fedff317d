"""Hugging Face's GPT2LMHeadModel as dtmega's GPT family."""

from __future__ import annotations

from dtmega.models.family import HFArchitecture
from dtmega.models.gpt.hf_config import ARCHITECTURE, gpt_config_from_hf, hf_config_from_gpt
from dtmega.models.gpt.hf_names import hf_source, hf_tensors


def _harmless(name: str, config) -> bool:
    """Older checkpoints' causal-mask buffers; a tied model's lm_head."""
    return name.endswith(("attn.bias", "attn.masked_bias")) and ".c_attn." not in name or (
        name == "lm_head.weight" and config.tie_embeddings)


GPT2_HF = HFArchitecture(
    names=(ARCHITECTURE,), model="gpt", family="dtmega-gpt", config_from_hf=gpt_config_from_hf,
    hf_config=hf_config_from_gpt, source=lambda name, config, names, hf: hf_source(name, config, names),
    tensors=hf_tensors, harmless=_harmless,
)
