"""Hugging Face's DeepseekV3ForCausalLM as dtmega's DeepSeek family."""

from __future__ import annotations

from dtmega.models.deepseek.hf_config import ARCHITECTURE, deepseek_config_from_hf, hf_config_from_deepseek
from dtmega.models.deepseek.hf_names import hf_source, hf_tensors, mtp_copies
from dtmega.models.family import HFArchitecture
from dtmega.models.llama.hf_names import WeightSource


def _source(name: str, config, names: set[str], hf: dict) -> WeightSource:
    return hf_source(name, config, names, bool(hf.get("rope_interleave", True)))


def _harmless(name: str, config) -> bool:
    """The MTP layers' copies of the shared embedding and head; a tied lm_head; RoPE tables."""
    copies = mtp_copies(config)
    return name in copies["tok_embeddings.weight"] or name in copies["output.weight"] or (
        name == "lm_head.weight" and config.tie_embeddings) or name.endswith("rotary_emb.inv_freq")


DEEPSEEK_HF = HFArchitecture(
    names=(ARCHITECTURE,), model="deepseek-v3", family="dtmega-deepseek", config_from_hf=deepseek_config_from_hf,
    hf_config=hf_config_from_deepseek, source=_source, tensors=hf_tensors, harmless=_harmless,
)
