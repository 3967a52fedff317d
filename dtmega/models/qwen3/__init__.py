"""Qwen3 (dense), in one folder: the model (model.py: dtmega's decoder with its q/k-norm slots
filled), named sizes with Qwen3's head width and tying (config.py, specs.py), what the passes
know (family.py), Hugging Face's Qwen3ForCausalLM both ways (hf_config.py, hf_names.py,
hf_architecture.py) and Megatron's --qk-layernorm/--kv-channels (megatron.py). Importing it
registers the family once (dtmega/models/family.py); nothing outside this folder names it."""

from dtmega.models.family import Family, register_model_family
from dtmega.models.qwen3.config import QWEN3_SIZES, qwen3_config
from dtmega.models.qwen3.family import DTMEGA_QWEN3
from dtmega.models.qwen3.hf_architecture import QWEN3_HF
from dtmega.models.qwen3.megatron import QWEN3_FLAGS
from dtmega.models.qwen3.model import Qwen3
from dtmega.models.qwen3.specs import QWEN3_SPECS

QWEN3 = register_model_family(Family(
    name="dtmega-qwen3", passes=DTMEGA_QWEN3, sizes=QWEN3_SPECS, hf=(QWEN3_HF,), megatron=QWEN3_FLAGS, kv_cache=True,
    description="Qwen3 dense: Llama's decoder with per-head q/k RMSNorm and a head width of its own",
))

__all__ = ["QWEN3", "QWEN3_SIZES", "Qwen3", "qwen3_config"]
