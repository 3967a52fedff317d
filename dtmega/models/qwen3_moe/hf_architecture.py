"""Hugging Face's Qwen3MoeForCausalLM as dtmega's Qwen3-MoE family."""

from __future__ import annotations

from dtmega.models.family import HFArchitecture
from dtmega.models.llama.hf_architecture import harmless_decoder_tensor
from dtmega.models.qwen3_moe.hf_config import ARCHITECTURE, hf_config_from_qwen3_moe, qwen3_moe_config_from_hf
from dtmega.models.qwen3_moe.hf_names import hf_source, hf_tensors

QWEN3_MOE_HF = HFArchitecture(
    names=(ARCHITECTURE,), model="qwen3-moe", family="dtmega-qwen3-moe", config_from_hf=qwen3_moe_config_from_hf,
    hf_config=hf_config_from_qwen3_moe, source=lambda name, config, names, hf: hf_source(name, config, names),
    tensors=hf_tensors, harmless=harmless_decoder_tensor,
)
