"""The kernel-fusion section of `dtmega train`'s arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtmega.passes import (
    AttentionBackend,
    FuseKernels,
    Pass,
)
from dtmega.passes.fused_ops import FUSED_OPS
from dtmega.train.arg_fields import opt as _opt

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class FusionArgs:
    """Fused kernels (FuseKernels: Triton on GPUs, the PyTorch references elsewhere)."""

    cross_entropy_loss_fusion: bool = _opt(False, "output layer + cross entropy in one chunked kernel (logits never "
                                                  "materialized; vocab-parallel under TP)")
    cross_entropy_fusion_impl: str = _opt("native", "which fused cross entropy: native (dtmega's kernel); te "
                                                    "(Transformer Engine's) is refused where it is not installed",
                                          ("native", "te"))
    no_rope_fusion: bool = _opt(False, "apply RoPE to q and k with plain PyTorch ops instead of one fused kernel")
    no_bias_swiglu_fusion: bool = _opt(False, "SwiGLU with plain PyTorch ops instead of the fused kernel")
    no_rms_norm_fusion: bool = _opt(False, "RMSNorm (and the residual add before it) without the fused kernels")
    attention_backend: str | None = _opt(None, "attention kernel: flash, fused (cuDNN's), unfused/local (plain math), "
                                               "or auto: the fastest for the run's shapes on this GPU, measured once "
                                               "and kept in $DTMEGA_CACHE_DIR (default on a GPU; on a CPU torch "
                                               "picks)", ("auto", "flash", "fused", "unfused", "local"))
    deterministic_mode: bool = _opt(False, "only deterministic kernels (torch.use_deterministic_algorithms, cuBLAS's "
                                           "fixed workspace): a rerun computes the same bits, and an op with no "
                                           "deterministic kernel raises naming itself (Megatron's --deterministic-mode)")

    def attention_passes(self) -> list[Pass]:
        """AttentionBackend for --attention-backend; without the flag, `auto` where a GPU can
        measure, else none (torch's scaled_dot_product_attention picks the kernel)."""
        import torch

        if self.attention_backend is not None:
            return [AttentionBackend(self.attention_backend)]
        return [AttentionBackend("auto")] if torch.cuda.is_available() else []

    def fusion_passes(self) -> list[Pass]:
        """FuseKernels with each registered op's switch from its flag: None lets FuseKernels decide
        (fused, except inside blocks compiled on a GPU, where inductor's fusion measured faster),
        False is off; no pass when every op is off."""
        switches = {op.switch: bool(getattr(self, op.flag)) if op.flag_turns_on
                    else (False if getattr(self, op.flag) else None)
                    for op in FUSED_OPS.values() if op.flag}
        return [FuseKernels(**switches)] if any(value is not False for value in switches.values()) else []
