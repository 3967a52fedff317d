"""Qwen3-MoE: dtmega's decoder with Qwen3's q/k-norm slots filled and mixture-of-experts
feed-forwards (dtmega/models/moe.py). A class of its own so that the family, its Hugging Face
architecture and its checkpoints know it by type."""

from __future__ import annotations

from dtmega.kernels.errors import DtmegaError
from dtmega.models.llama.config import LlamaConfig
from dtmega.models.qwen3.model import Qwen3


class Qwen3Moe(Qwen3):
    """Qwen3MoeForCausalLM's computation on dtmega's decoder. Build it under
    `torch.device("meta")`, shard it, then `init_weights()`."""

    def __init__(self, config: LlamaConfig):
        moe = config.moe
        if moe is None:
            raise DtmegaError("Qwen3-MoE has experts: its config needs moe=MoEConfig(...) "
                              "(dtmega.models.qwen3_moe.config.qwen3_moe_config builds one); a dense Qwen3 is "
                              "dtmega.models.Qwen3")
        if moe.shared_expert_ffn_dim or moe.score_func != "softmax" or moe.expert_bias or moe.activation != "swiglu":
            raise DtmegaError("Qwen3-MoE routes with a softmax over SwiGLU experts, without shared experts or expert "
                              f"bias; this config has score_func={moe.score_func!r}, shared_expert_ffn_dim="
                              f"{moe.shared_expert_ffn_dim}, expert_bias={moe.expert_bias}, activation="
                              f"{moe.activation!r}. Fix: dtmega.models.Llama builds other MoE decoders")
        super().__init__(config)
