"""The GPT family (Megatron's GPT blocks: GPT-2, GPT-3 and every `pretrain_gpt.py` line without the
Llama block's flags), in one folder: the model (model.py, dropout.py), named sizes (config.py,
specs.py), what the passes know (family.py), Hugging Face's GPT2LMHeadModel both ways
(hf_config.py, hf_names.py, hf_architecture.py) and Megatron's flags (megatron.py). Importing it
registers the family once (dtmega/models/family.py)."""

from dtmega.models.family import Family, register_model_family
from dtmega.models.gpt.config import GPT_SIZES, GPTConfig
from dtmega.models.gpt.family import DTMEGA_GPT
from dtmega.models.gpt.hf_architecture import GPT2_HF
from dtmega.models.gpt.megatron import GPT_FLAGS
from dtmega.models.gpt.model import GPT
from dtmega.models.gpt.specs import GPT_SPECS

GPT_FAMILY = register_model_family(Family(
    name="dtmega-gpt", passes=DTMEGA_GPT, sizes=GPT_SPECS, hf=(GPT2_HF,), megatron=GPT_FLAGS, kv_cache=True,
    description="Megatron's GPT blocks: LayerNorm, learned positions, biases, GeLU, dropout, tied output",
))

__all__ = ["GPT", "GPTConfig", "GPT_FAMILY", "GPT_SIZES"]
