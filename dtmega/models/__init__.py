"""Reference models, one folder per family (dtmega/models/llama/, dtmega/models/deepseek/), and the model registry.
Importing this registers the families' rule sets with the pass compiler and their named sizes."""

from dtmega.models.deepseek import DeepSeek, DeepSeekConfig
from dtmega.models.llama import NAMED_CONFIGS, Llama, LlamaConfig, RopeScaling
from dtmega.models.registry import ModelSpec, count_parameters, model_names, model_spec, register_model

__all__ = ["DeepSeek", "DeepSeekConfig", "Llama", "LlamaConfig", "ModelSpec", "NAMED_CONFIGS", "RopeScaling",
           "count_parameters", "model_names", "model_spec", "register_model"]
