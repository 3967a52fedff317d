"""The kernel-fusion section of `dtmega train`'s arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtmega.passes import (
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

    def fusion_passes(self) -> list[Pass]:
        """FuseKernels with each registered op's switch from its flag: None lets FuseKernels decide
        (fused, except inside blocks compiled on a GPU, where inductor's fusion measured faster),
        False is off; no pass when every op is off."""
        switches = {op.switch: bool(getattr(self, op.flag)) if op.flag_turns_on
                    else (False if getattr(self, op.flag) else None)
                    for op in FUSED_OPS.values() if op.flag}
        return [FuseKernels(**switches)] if any(value is not False for value in switches.values()) else []
