"""Qwen3-MoE, in one folder: the model (model.py: dtmega's decoder with Qwen3's q/k-norm slots
and mixture-of-experts blocks), named sizes (config.py, specs.py: qwen3-30b-a3b, qwen3-235b-a22b),
what the passes know (family.py), Hugging Face's Qwen3MoeForCausalLM both ways (hf_config.py,
hf_names.py, hf_architecture.py) and Megatron's --qk-layernorm with --num-experts (megatron.py).
Importing it registers the family once (dtmega/models/family.py); nothing outside this folder
names it."""

from dtmega.models.family import Family, register_model_family
from dtmega.models.qwen3_moe.config import QWEN3_MOE_SIZES, qwen3_moe_config
from dtmega.models.qwen3_moe.family import DTMEGA_QWEN3_MOE
from dtmega.models.qwen3_moe.hf_architecture import QWEN3_MOE_HF
from dtmega.models.qwen3_moe.megatron import QWEN3_MOE_FLAGS
from dtmega.models.qwen3_moe.model import Qwen3Moe
from dtmega.models.qwen3_moe.specs import QWEN3_MOE_SPECS

QWEN3_MOE = register_model_family(Family(
    name="dtmega-qwen3-moe", passes=DTMEGA_QWEN3_MOE, sizes=QWEN3_MOE_SPECS, hf=(QWEN3_MOE_HF,),
    megatron=QWEN3_MOE_FLAGS, kv_cache=True,
    description="Qwen3-MoE: Qwen3's attention with softmax top-k experts (normalized top-k weights), no shared expert",
))

__all__ = ["QWEN3_MOE", "QWEN3_MOE_SIZES", "Qwen3Moe", "qwen3_moe_config"]
