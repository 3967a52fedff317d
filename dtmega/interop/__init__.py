"""Checkpoints in and out of dtmega: Hugging Face safetensors (read shard by shard under any
plan, written streamed) and Megatron-Core torch_dist checkpoints. docs/checkpoints.md."""

from dtmega.interop.hf_checkpoint import HFCheckpoint
from dtmega.interop.hf_export import export_hf
from dtmega.interop.hf_import import import_hf
from dtmega.models.llama.hf_config import (
    HFFormatError,
    hf_config_from_llama,
    llama_config_from_hf,
)

__all__ = ["HFCheckpoint", "HFFormatError", "export_hf", "hf_config_from_llama", "import_hf", "llama_config_from_hf"]
