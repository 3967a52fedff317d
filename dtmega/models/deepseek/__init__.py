"""dtmega's DeepSeek-V3 family, in one folder: multi-latent attention and DeepSeek's mixture of
experts (model.py, rope.py), its config and named sizes (config.py, specs.py), what the passes
know of it (family.py), the Hugging Face maps (hf_config.py, hf_names.py, hf_architecture.py)
and Megatron's MLA flags (megatron.py). Importing it registers the family once."""

from dtmega.models.deepseek.config import NAMED_CONFIGS, DeepSeekConfig, YarnScaling
from dtmega.models.deepseek.family import DTMEGA_DEEPSEEK
from dtmega.models.deepseek.hf_architecture import DEEPSEEK_HF
from dtmega.models.deepseek.megatron import DEEPSEEK_FLAGS
from dtmega.models.deepseek.model import DeepSeek
from dtmega.models.deepseek.specs import DEEPSEEK_SIZES
from dtmega.models.family import Family, register_model_family

DEEPSEEK = register_model_family(Family(
    name="dtmega-deepseek", passes=DTMEGA_DEEPSEEK, sizes=DEEPSEEK_SIZES, hf=(DEEPSEEK_HF,), megatron=DEEPSEEK_FLAGS,
    multi_token_prediction=True, kv_cache=True,
    description="DeepSeek-V3: multi-latent attention, fine-grained experts with group-limited routing, MTP",
))

__all__ = ["DEEPSEEK", "DeepSeek", "DeepSeekConfig", "NAMED_CONFIGS", "YarnScaling"]
