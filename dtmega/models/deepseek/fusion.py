"""Where dtmega's DeepSeek has its hot paths, for `FuseKernels` (registered with
`register_fusion` beside the family): the same fused ops as the Llama's, at this family's sites.

Every RMSNorm runs `rms_norm` (the blocks' attention norms, MLA's query and key/value latent
norms, the final norm, the multi-token-prediction module's norms); each block's residual add
and its second norm `rms_norm_residual` (the block has the Llama block's shape, so its rewrite
is the Llama's); the dense and shared-expert MLPs `swiglu`; the queries' rotary channels and the
shared rotary key their RoPE in one `rope_qk` launch (the key is one head: multi-query). The
routed experts keep their grouped GEMMs.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dtmega.kernels.rope import apply_rope_qk
from dtmega.models.feed_forward import FeedForward
from dtmega.models.llama.fusion import fuse_block_residual
from dtmega.passes.fusion_sites import fused_rms_norm, register_fusion, swiglu_w123


def fusion_sites(model: nn.Module) -> dict[str, list[str]]:
    """The module FQNs of each fused op in a dtmega DeepSeek."""
    depths = len(model.mtp) if model.mtp is not None else 0
    blocks = [f"layers.{name}" for name in model.layers] + [f"mtp.{i}.block" for i in range(depths)]
    latent_norms = [f"{b}.attention.{norm}" for b in blocks for norm in ("q_norm", "kv_norm")
                    if hasattr(model.get_submodule(f"{b}.attention"), norm)]
    mtp_norms = [f"mtp.{i}.{norm}" for i in range(depths) for norm in ("enorm", "hnorm", "norm")]
    return {
        "rms_norm": [f"{b}.attention_norm" for b in blocks] + latent_norms + mtp_norms + ["norm"],
        "rms_norm_residual": [f"{b}.ffn_norm" for b in blocks],
        "swiglu": [fqn for fqn, m in model.named_modules() if isinstance(m, FeedForward)],
        "rope": [f"{b}.attention" for b in blocks],
    }


def fused_latent_rope(module: nn.Module, impl: str) -> Callable:
    """MLA with its `rotate` through one `rope_qk` launch: the queries' rotary channels and the
    one rotary key (decoding with a cache keeps the plain path). The model hands the attention
    the cos/sin rows of its positions ([1 or B, S, rope/2, 2]): the kernel's table, read at index
    b * S + s. Returns the attention's forward, unchanged: only `rotate` is replaced."""
    plain = module.rotate

    def rotate(q_rot, k_rot, rope, decoding=False):
        if decoding:
            return plain(q_rot, k_rot, rope, decoding=True)
        batch, seq = q_rot.shape[:2]
        table = rope[0] if rope.shape[0] == 1 else rope.flatten(0, 1)
        positions = None if rope.shape[0] == 1 else torch.arange(batch * seq, device=q_rot.device).view(batch, seq)
        return apply_rope_qk(q_rot.contiguous(), k_rot.contiguous(), table, positions, impl=impl)

    module.rotate = rotate
    return module.forward


register_fusion("dtmega-deepseek", fusion_sites,
                {"rms_norm": fused_rms_norm, "swiglu": swiglu_w123, "rope": fused_latent_rope},
                block_residual=fuse_block_residual)
