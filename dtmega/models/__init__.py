"""Reference models. Importing this registers their rule sets with the pass compiler."""

from dtmega.models import llama_family as _llama_family  # noqa: F401  (registers the family)
from dtmega.models import llama_specs as _llama_specs  # noqa: F401  (registers the named sizes)
from dtmega.models.llama import Llama
from dtmega.models.llama_config import NAMED_CONFIGS, LlamaConfig, RopeScaling
from dtmega.models.registry import (
           ModelSpec,
           count_parameters,
           model_names,
           model_spec,
           register_model,
)

__all__ = ["Llama", "LlamaConfig", "ModelSpec", "NAMED_CONFIGS", "RopeScaling", "count_parameters", "model_names",
           "model_spec", "register_model"]
