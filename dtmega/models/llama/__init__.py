"""dtmega's Llama family, in one folder: the model (model.py), its config and named sizes
(config.py, specs.py), what the passes know of it (family.py: rule sets, facts, hooks; fusion.py:
FuseKernels' sites; the recomputed attention core), the Hugging Face name and config maps
(hf_names.py, hf_config.py) and the cost model's shapes (specs.py). Importing it registers the
family, its fusion sites and its named sizes."""

from dtmega.models.llama import family as _family  # noqa: F401  (registers the family and its fusion sites)
from dtmega.models.llama import specs as _specs  # noqa: F401  (registers the named sizes)
from dtmega.models.llama.config import NAMED_CONFIGS, LlamaConfig, RopeScaling
from dtmega.models.llama.model import Llama

__all__ = ["Llama", "LlamaConfig", "NAMED_CONFIGS", "RopeScaling"]
