"""Hugging Face's Qwen3ForCausalLM as dtmega's Qwen3 family."""

from __future__ import annotations

from dtmega.models.family import HFArchitecture
from dtmega.models.llama.hf_architecture import harmless_decoder_tensor
from dtmega.models.qwen3.hf_config import ARCHITECTURE, hf_config_from_qwen3, qwen3_config_from_hf
from dtmega.models.qwen3.hf_names import hf_source, hf_tensors

QWEN3_HF = HFArchitecture(
    names=(ARCHITECTURE,), model="qwen3", family="dtmega-qwen3", config_from_hf=qwen3_config_from_hf,
    hf_config=hf_config_from_qwen3, source=lambda name, config, names, hf: hf_source(name, config, names),
    tensors=hf_tensors, harmless=harmless_decoder_tensor,
)
