"""dtmega's Llama family, in one folder: the model (model.py), its config and named sizes
(config.py, specs.py), what the passes know of it (family.py: facts, rule sets, fusion sites,
the recomputed attention core), the Hugging Face maps (hf_config.py, hf_names.py,
hf_architecture.py) and Megatron's flags (megatron.py). Importing it registers the family once
(dtmega/models/family.py)."""

from dtmega.models.family import Family, register_model_family
from dtmega.models.llama.config import NAMED_CONFIGS, LlamaConfig, RopeScaling
from dtmega.models.llama.family import DTMEGA_LLAMA
from dtmega.models.llama.hf_architecture import LLAMA_HF
from dtmega.models.llama.megatron import LLAMA_FLAGS
from dtmega.models.llama.model import Llama
from dtmega.models.llama.specs import LLAMA_SIZES

LLAMA = register_model_family(Family(
    name="dtmega-llama", passes=DTMEGA_LLAMA, sizes=LLAMA_SIZES, hf=(LLAMA_HF,), megatron=LLAMA_FLAGS, kv_cache=True,
    description="Llama-3 decoders (GQA, SwiGLU, RMSNorm, RoPE), dense or with Mixtral/DeepSeek-style experts",
))

__all__ = ["LLAMA", "Llama", "LlamaConfig", "NAMED_CONFIGS", "RopeScaling"]
