"""Qwen3 (dense): dtmega's Llama decoder with its q/k-norm slots filled (dtmega/models/llama/model.py,
`Attention.q_norm`/`k_norm`: RMSNorm over each head's channels, before RoPE). A class of its
own so that the family, its Hugging Face architecture and its checkpoints know it by type."""

from __future__ import annotations

from dtmega.kernels.errors import DtmegaError
from dtmega.models.llama.config import LlamaConfig
from dtmega.models.llama.model import Llama


class Qwen3(Llama):
    """Qwen3ForCausalLM's computation on dtmega's decoder. Build it under `torch.device("meta")`,
    shard it, then `init_weights()` (the q/k norms start at one, as every RMSNorm)."""

    def __init__(self, config: LlamaConfig):
        if not config.qk_norm:
            raise DtmegaError("Qwen3 normalizes queries and keys per head: its config needs qk_norm=True "
                              "(dtmega.models.qwen3.config.qwen3_config builds one)")
        super().__init__(config)
