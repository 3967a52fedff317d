"""What the passes know of Qwen3-MoE: dtmega's decoder family (dtmega/models/llama/family.py)
under its own name, matching the Qwen3Moe class: q/k-norm slots sharded with the heads under TP,
experts split by expert parallelism and on their hidden dim by expert tensor parallelism, the
router replicated."""

from __future__ import annotations

from dtmega.models.llama.family import decoder_passes_family
from dtmega.models.qwen3_moe.model import Qwen3Moe

DTMEGA_QWEN3_MOE = decoder_passes_family("dtmega-qwen3-moe", Qwen3Moe)
