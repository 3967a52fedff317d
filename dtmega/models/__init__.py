"""Reference models, one folder per family (dtmega/models/llama/, qwen3/, qwen3_moe/, deepseek/, gpt/), each registered
once as a `Family` (dtmega/models/family.py), and the model registry. Importing this registers
the families: their passes' rule sets, named sizes, Hugging Face architectures and Megatron flags."""

from dtmega.models.llama import NAMED_CONFIGS, Llama, LlamaConfig, RopeScaling  # noqa: I001  (Llama first: the default family)
from dtmega.models.qwen3 import QWEN3_SIZES, Qwen3
from dtmega.models.qwen3_moe import QWEN3_MOE_SIZES, Qwen3Moe
from dtmega.models.deepseek import DeepSeek, DeepSeekConfig
from dtmega.models.gpt import GPT, GPT_SIZES, GPTConfig
from dtmega.models.family import (
    Family,
    HFArchitecture,
    MegatronSizing,
    family_for_flags,
    model_families,
    model_family,
    register_model_family,
)
from dtmega.models.registry import ModelSpec, count_parameters, model_names, model_spec, register_model

__all__ = [
    "DeepSeek",
    "DeepSeekConfig",
    "Family",
    "GPT",
    "GPTConfig",
    "GPT_SIZES",
    "HFArchitecture",
    "Llama",
    "LlamaConfig",
    "MegatronSizing",
    "ModelSpec",
    "NAMED_CONFIGS",
    "QWEN3_MOE_SIZES",
    "QWEN3_SIZES",
    "Qwen3",
    "Qwen3Moe",
    "RopeScaling",
    "count_parameters",
    "family_for_flags",
    "model_families",
    "model_family",
    "model_names",
    "model_spec",
    "register_model",
    "register_model_family",
]
