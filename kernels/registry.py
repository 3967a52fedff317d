"""The kernel registry: every implementation a plan can choose for a module, by name.

A pass writes a kernel name into a module's layout entry (`entry.kernel`); `apply` reads it and
swaps or wraps the module accordingly, and the report shows what will actually run. Each
kernel says what it computes (`op`), which kernel is its plain-PyTorch ground truth
(`reference`), and what it needs to run (device types, optional packages), so a plan that asks
for a kernel the machine cannot run is refused before anything is built, with the reason.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelSpec:
    """One implementation of an op."""

    name: str  # e.g. "attention.context_parallel.ring"
    op: str  # what it computes, e.g. "attention"
    description: str
    reference: str | None = None  # the ground-truth kernel it is tested against (None: it is one)
    devices: tuple[str, ...] = ()  # device types it runs on (empty: any)
    packages: tuple[str, ...] = ()  # optional Python packages it imports

    def unavailable(self, device_type: str | None) -> str | None:
        """Why this kernel cannot run on `device_type` (None: it can; device None: not checked)."""
        if device_type is not None and self.devices and device_type not in self.devices:
            return f"kernel {self.name!r} runs on {'/'.join(self.devices)}, not {device_type}"
        missing = [p for p in self.packages if importlib.util.find_spec(p) is None]
        if missing:
            return f"kernel {self.name!r} needs the package(s) {missing}, which are not installed"
        return None


_KERNELS: dict[str, KernelSpec] = {}


def register_kernel(spec: KernelSpec, *, replace: bool = False) -> KernelSpec:
    """Makes a kernel choosable by name; a second registration of a name needs `replace=True`."""
    if spec.name in _KERNELS and not replace and _KERNELS[spec.name] != spec:
        raise ValueError(f"a kernel named {spec.name!r} is already registered; pass replace=True to replace it")
    _KERNELS[spec.name] = spec
    return spec


def kernel_spec(name: str) -> KernelSpec:
    """The registered kernel `name`; KeyError listing the known ones otherwise."""
    if name not in _KERNELS:
        raise KeyError(f"no kernel named {name!r}; registered kernels: {', '.join(sorted(_KERNELS))}")
    return _KERNELS[name]


def kernels_for(op: str) -> list[KernelSpec]:
    """Every registered kernel that computes `op`."""
    return [spec for spec in _KERNELS.values() if spec.op == op]


def registered_kernels() -> list[str]:
    """Names of every registered kernel."""
    return sorted(_KERNELS)


for _spec in (
    KernelSpec("attention.sdpa", "attention", "torch's scaled_dot_product_attention (flash/efficient/math kernels)"),
    *(KernelSpec(f"attention.sdpa.{name}", "attention", f"scaled_dot_product_attention restricted to its {what} kernel "
                 "(AttentionBackend)", reference=None if name == "math" else "attention.sdpa.math", devices=devices)
      for name, what, devices in (("flash", "FlashAttention", ("cuda", "cpu")), ("cudnn", "cuDNN fused", ("cuda",)),
                                  ("efficient", "memory-efficient", ("cuda",)), ("math", "unfused math", ()))),
    KernelSpec("attention.flex", "attention", "FlexAttention with a causal BlockMask (AttentionBackend)",
               reference="attention.sdpa.math", devices=("cuda",)),
    KernelSpec("attention.recomputed", "attention", "selective recompute: one op that keeps q, k, v and recomputes "
               "the attention in backward", reference="attention.sdpa"),
    *(KernelSpec(f"attention.context_parallel.{method}", "attention", f"context-parallel attention ({method})",
                 reference="attention.sdpa") for method in ("ring", "all_gather", "a2a")),
    KernelSpec("attention.document.flex", "attention", "packed documents: FlexAttention with a document BlockMask "
               "(masked blocks skipped, no [S, S] tensor)", reference="attention.document.sdpa"),
    KernelSpec("attention.document.varlen", "attention", "packed documents: each document its own causal attention",
               reference="attention.document.sdpa"),
    KernelSpec("attention.document.sdpa", "attention", "packed documents: scaled_dot_product_attention with a dense "
               "document mask"),
    *(KernelSpec(f"moe.dispatch.{kind}", "moe_dispatch", f"{kind} token dispatch to the experts' ranks")
      for kind in ("alltoall", "allgather", "flex")),
    KernelSpec("cross_entropy.logits", "cross_entropy", "logits, then per-token cross entropy (loss-parallel when "
               "the logits are vocab-sharded)"),
):
    register_kernel(_spec)
