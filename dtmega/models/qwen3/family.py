"""What the passes know of Qwen3: dtmega's decoder family (dtmega/models/llama/family.py) under
its own name, matching the Qwen3 class: the q/k-norm slots are sharded with the heads under TP
(`head_norm`), fused by FuseKernels as RMSNorm, and head_dim is the config's own."""

from __future__ import annotations

from dtmega.models.llama.family import decoder_passes_family
from dtmega.models.qwen3.model import Qwen3

DTMEGA_QWEN3 = decoder_passes_family("dtmega-qwen3", Qwen3)
