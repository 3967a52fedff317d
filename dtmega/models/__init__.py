"""Reference models. Importing this registers their rule sets with the pass compiler."""

from dtmega.models.llama import Llama
from dtmega.models.llama_config import NAMED_CONFIGS, LlamaConfig, RopeScaling
from dtmega.models import llama_family as _llama_family  # noqa: F401  (registers the family)

__all__ = ["Llama", "LlamaConfig", "RopeScaling", "NAMED_CONFIGS"]
