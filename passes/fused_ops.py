"""The ops `FuseKernels` can run through a fused kernel, each registered once with everything
the pass, the trainer's flags and the cost model read of it.

`register_fused_op(FusedOp(...))` registers the op's two kernels (`<name>.triton`, CUDA with
triton installed; `<name>.reference`, the plain-PyTorch path that runs anywhere) and says which
`FuseKernels` switch turns it off, which trainer flag sets that switch (Megatron's spelling),
whether it runs inside the transformer blocks (then, in blocks compiled on a GPU, it is left
to inductor unless forced) and whether it saves fewer activations than the unfused ops (the
cost model's activation formula takes that). Where in a model each op runs is the family's
(`ModelFamily.fusion_sites`, passes/fusion_sites.py; the modules it swaps in, passes/fused_modules.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtmega.kernels.registry import KernelSpec, register_kernel

IMPLS = ("triton", "reference")


@dataclass(frozen=True)
class FusedOp:
    """One fusable op (see the module docstring)."""

    name: str  # its kernels are f"{name}.triton" and f"{name}.reference"
    what: str
    switch: str  # the FuseKernels field that turns it off (None there: FuseKernels decides)
    flag: str | None = None  # the TrainArgs field of the trainer's switch
    flag_turns_on: bool = False  # the flag turns the op on (an opt-in op); else it turns it off
    in_blocks: bool = True  # runs inside the transformer blocks
    saves_activations: bool = False  # the fused kernel saves fewer activations than the unfused ops


FUSED_OPS: dict[str, FusedOp] = {}


def register_fused_op(op: FusedOp) -> FusedOp:
    """Makes `op` known to FuseKernels, the trainer's flags and the cost model, and registers its
    Triton and reference kernels."""
    FUSED_OPS[op.name] = op
    for impl in IMPLS:
        register_kernel(KernelSpec(f"{op.name}.{impl}", op.name, f"{op.what} ({impl})",
                                   devices=("cuda",) if impl == "triton" else (),
                                   packages=("triton",) if impl == "triton" else (),
                                   reference=None if impl == "reference" else f"{op.name}.reference"), replace=True)
    return op


def fused_op_of(kernel: str | None) -> FusedOp | None:
    """The fused op a layout's kernel name belongs to (e.g. "rms_norm.triton"), or None."""
    return FUSED_OPS.get((kernel or "").rpartition(".")[0])


LOSS = "cross_entropy.fused_linear"

register_fused_op(FusedOp("rms_norm", "RMSNorm", "rms_norm", "no_rms_norm_fusion", saves_activations=True))
register_fused_op(FusedOp("rms_norm_residual", "residual add + RMSNorm", "rms_norm", "no_rms_norm_fusion",
                          saves_activations=True))
register_fused_op(FusedOp("swiglu", "silu(a) * b", "swiglu", "no_bias_swiglu_fusion", saves_activations=True))
register_fused_op(FusedOp("rope", "RoPE of q and k in one launch", "rope", "no_rope_fusion"))
register_fused_op(FusedOp(LOSS, "output projection + cross entropy in chunks of tokens", "cross_entropy",
                          "cross_entropy_loss_fusion", flag_turns_on=True, in_blocks=False))
