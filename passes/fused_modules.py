"""The slot modules `FuseKernels` puts into a model: the same ops as the model's own slot modules
(dtmega/models/slots.py, and torch's and Hugging Face's RMSNorms), with the same call signatures
and the same parameters, run by dtmega's fused kernels.

Each op knows exactly which modules it may replace (`KNOWN`): a class it has the semantics of,
with exactly the parameters it reads. A module of another class, or with another parameter, at a
site is refused by name before anything is built (`check_site`): a kernel never silently drops
what a module holds or computes.
"""

from __future__ import annotations

import torch
from torch import nn

from dtmega.kernels.rmsnorm import rms_norm, rms_norm_residual
from dtmega.kernels.rope import apply_rope_qk
from dtmega.kernels.swiglu import swiglu
from dtmega.passes.errors import PlanError
from dtmega.passes.fused_ops import FUSED_OPS

# op -> the classes (module path, name) whose computation the op's kernel performs, and the
# parameters it reads from them
KNOWN: dict[str, tuple[set[tuple[str, str]], tuple[str, ...]]] = {
    "rms_norm": ({("torch.nn.modules.normalization", "RMSNorm"), ("dtmega.models.slots", "RMSNorm"),
                  ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
                  ("transformers.models.mixtral.modeling_mixtral", "MixtralRMSNorm"),
                  ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm")}, ("weight",)),
    # the residual add before a block's norm: the norm's `add_then_norm` (dtmega's slot RMSNorm)
    "rms_norm_residual": ({("dtmega.models.slots", "RMSNorm")}, ("weight",)),
    "rope": ({("dtmega.models.slots", "Rotary")}, ()),
    "swiglu": ({("dtmega.models.slots", "SwiGLU")}, ()),
}


def register_known(op: str, module: str, class_name: str) -> None:
    """Declares that `op`'s kernel computes what `module.class_name` computes (a family of one's
    own with a norm class of its own registers it next to its fusion sites)."""
    KNOWN[op][0].add((module, class_name))


def _computes_as_known(module: nn.Module, classes: set[tuple[str, str]]) -> bool:
    """Whether `module` computes what a known class computes: it is one, or a subclass that
    overrides none of its methods (torchtitan's RMSNorm is torch's with a config; a
    researcher's subclass with its own forward is not)."""
    for base in type(module).__mro__:
        if (base.__module__, base.__name__) in classes:
            return all(getattr(type(module), name) is getattr(base, name)
                       for name in ("forward", "add_then_norm") if hasattr(base, name))
    return False


def check_site(op: str, fqn: str, module: nn.Module) -> None:
    """PlanError unless `op`'s kernel knows `module`: a known class (or a subclass overriding
    none of its methods), exactly the parameters the kernel reads, no submodules (the kernel
    would drop what they compute)."""
    classes, params = KNOWN[op]
    kind = (type(module).__module__, type(module).__name__)
    held = tuple(name for name, _ in module.named_parameters())
    children = [name for name, _ in module.named_children()]
    known = _computes_as_known(module, classes)
    if known and set(held) == set(params) and not children:
        return
    why = (f"its class {kind[0]}.{kind[1]} is not one the kernel computes" if not known else
           f"it holds {', '.join(held + tuple(children)) or 'nothing'}, the kernel reads {', '.join(params) or 'nothing'}")
    raise PlanError(f"FuseKernels would replace {fqn} by the {op} kernel, but {why}: its computation would be dropped. "
                    f"Fix: FuseKernels({FUSED_OPS[op].switch}=False), or "
                    "dtmega.passes.fused_modules.register_known for a class whose semantics are the op's")


def norm_eps(module: nn.Module) -> float:
    """The epsilon of an RMSNorm module (torch's `eps`, Hugging Face's `variance_epsilon`)."""
    eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", None)
    return float(eps) if eps is not None else float(torch.finfo(torch.float32).eps)


class FusedRMSNorm(nn.Module):
    """An RMSNorm through `rms_norm` (and, with `residual`, its `add_then_norm` through
    `rms_norm_residual`: the add and the norm in one pass), on the replaced norm's weight."""

    def __init__(self, norm: nn.Module, impl: str, residual: bool = False):
        super().__init__()
        self.weight = norm.weight
        self.eps, self.impl, self.residual = norm_eps(norm), impl, residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, impl=self.impl)

    def add_then_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + delta), x + delta), as dtmega's RMSNorm slot; the residual stream keeps its dtype."""
        if not self.residual:
            summed = x + delta.to(x.dtype)
            return self(summed), summed
        return rms_norm_residual(x, delta.to(x.dtype), self.weight, self.eps, impl=self.impl)


class FusedRotary(nn.Module):
    """RoPE on q and k in one `rope_qk` launch. The model hands the cos/sin rows of the
    positions ([1 or B, S, D/2, 2]): they are the kernel's table, read at index b * S + s."""

    def __init__(self, impl: str):
        super().__init__()
        self.impl = impl

    def forward(self, q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq = q.shape[:2]
        table = rope[0] if rope.shape[0] == 1 else rope.flatten(0, 1)
        positions = None if rope.shape[0] == 1 else torch.arange(batch * seq, device=q.device).view(batch, seq)
        return apply_rope_qk(q.contiguous(), k.contiguous(), table, positions, impl=self.impl)


class FusedSwiGLU(nn.Module):
    """silu(gate) * up through `swiglu`."""

    def __init__(self, impl: str):
        super().__init__()
        self.impl = impl

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate, up, impl=self.impl)


def fused_module(op: str, old: nn.Module, impl: str) -> nn.Module:
    """The module that runs `op`'s kernel in place of `old` (checked by `check_site`)."""
    if op in ("rms_norm", "rms_norm_residual"):
        return FusedRMSNorm(old, impl, residual=op == "rms_norm_residual")
    if op == "rope":
        return FusedRotary(impl)
    return FusedSwiGLU(impl)
