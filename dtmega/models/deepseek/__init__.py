"""dtmega's DeepSeek-V3 family, in one folder: multi-latent attention and DeepSeek's mixture of
experts (model.py, rope.py), its config and named sizes (config.py, specs.py), what the passes
know of it (family.py) and the Hugging Face config and name maps (hf_config.py, hf_names.py).
Importing it registers the family and its named sizes."""

from dtmega.models.deepseek import family as _family  # noqa: F401  (registers the family)
from dtmega.models.deepseek import specs as _specs  # noqa: F401  (registers the named sizes)
from dtmega.models.deepseek.config import NAMED_CONFIGS, DeepSeekConfig, YarnScaling
from dtmega.models.deepseek.model import DeepSeek

__all__ = ["DeepSeek", "DeepSeekConfig", "NAMED_CONFIGS", "YarnScaling"]
