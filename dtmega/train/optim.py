"""The optimizer side of a step: AdamW groups, the global gradient norm, clipping, and fp16
dynamic loss scaling. All of it works on DTensor parameters of any plan."""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _decay_groups(model: torch.nn.Module, weight_decay: float) -> tuple[list[dict], bool]:
    """The parameter groups Megatron makes: weight decay on matrices, none on norms and biases
    (every 1-D parameter); and whether every parameter is on a GPU (the fused kernels then:
    one launch for all parameters, DTensor parameters included)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = bool(decay + no_decay) and all(p.is_cuda for p in decay + no_decay)
    return [g for g in groups if g["params"]], fused


def adamw(model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
          eps: float) -> torch.optim.AdamW:
    """AdamW (Megatron's `--optimizer adam`: decoupled weight decay) with no weight decay on
    norms and biases; the fused CUDA kernel where every parameter is on a GPU, torch's foreach
    implementation elsewhere."""
    groups, fused = _decay_groups(model, weight_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


def sgd(model: torch.nn.Module, *, lr: float, weight_decay: float, momentum: float) -> torch.optim.SGD:
    """SGD with momentum (Megatron's `--optimizer sgd`, `--sgd-momentum`): weight decay is
    torch's L2 term, as Megatron's SGD applies it, never on norms and biases; fused on GPUs."""
    groups, fused = _decay_groups(model, weight_decay)
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, fused=fused or None)


# Reducing a scalar norm over a 2-D mesh takes two all-reduces; torch warns about it once per
# process, which is noise for a scalar.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _group_key(grad: torch.Tensor):
    if isinstance(grad, DTensor):
        return grad.device_mesh, tuple(grad.placements)
    return None, None


@torch.no_grad()
def grad_norm(parameters, pipeline_group=None) -> torch.Tensor:
    """The L2 norm of all gradients as if unsharded, a 0-dim fp32 tensor on the gradients'
    device (identical on every rank; no host synchronization).

    One reduction per (mesh, placements) group of gradients, not one per gradient; with
    pipeline stages, the squared norms of the stages are summed over `pipeline_group`.
    """
    return _norm([param.grad for param in parameters if param.grad is not None and not _tied_copy(param)],
                 pipeline_group)


def _tied_copy(param) -> bool:
    """The last pipeline stage's copy of a tied embedding: counted once, by the embedding
    (passes/tied_embeddings.py; Megatron's `param.shared`)."""
    return bool(getattr(param, "dtmega_tied_copy", False))


def _norm(tensors: list[torch.Tensor], pipeline_group=None) -> torch.Tensor:
    """The L2 norm of `tensors` as if unsharded: one reduction per (mesh, placements) group;
    with pipeline stages, the squared norms of the stages summed over `pipeline_group`."""
    groups = defaultdict(list)
    for tensor in tensors:
        groups[_group_key(tensor)].append(tensor)
    total = None
    for members in groups.values():
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(members, 2.0)), 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total = norm.float() ** 2 if total is None else total + norm.float() ** 2
    if total is None:
        return torch.zeros(())
    if pipeline_group is not None:
        dist.all_reduce(total, group=pipeline_group)
    return total.sqrt()


@torch.no_grad()
def params_norm(parameters, pipeline_group=None) -> float:
    """The L2 norm of all parameters as if unsharded (--log-params-norm), identical on every
    rank; grouped like `grad_norm`."""
    return float(_norm([param.detach() for param in parameters if not _tied_copy(param)], pipeline_group))


@torch.no_grad()
def zeros_in_grad(parameters, pipeline_group=None) -> int:
    """How many gradient entries are exactly zero, counted over the unsharded gradients
    (--log-num-zeros-in-grad); identical on every rank."""
    total = torch.zeros((), dtype=torch.float64)
    for param in parameters:
        if param.grad is None or _tied_copy(param):
            continue
        count = (param.grad == 0).sum()
        if isinstance(count, DTensor):
            count = count.full_tensor()
        total += count.double().cpu()
    if pipeline_group is not None:
        dist.all_reduce(total, group=pipeline_group)
    return int(total.item())


def global_grad_norm(parameters, pipeline_group=None) -> float:
    """`grad_norm` as a Python float (synchronizes with the device)."""
    return float(grad_norm(parameters, pipeline_group))


@torch.no_grad()
def clip_grads_(parameters, max_norm: float, norm: torch.Tensor) -> None:
    """Scales every gradient by min(1, max_norm / norm) on the device (no host synchronization)."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
    if grads:
        factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, factor.to(grads[0].device))


@torch.no_grad()
def scale_grads(parameters, factor: float) -> None:
    """Multiplies every gradient by `factor` (local shards, no communication)."""
    for param in parameters:
        if param.grad is not None:
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            grad.mul_(factor)


@dataclass
class LossScaler:
    """fp16 loss scaling as Megatron does it: dynamic (halve after `hysteresis` overflows,
    double after `window` clean steps) or static (`dynamic=False`)."""

    scale: float = 2.0**32
    dynamic: bool = True
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    _clean_steps: int = 0
    _overflows_left: int = 2

    def __post_init__(self) -> None:
        self._overflows_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        """Adjusts the scale after a step that did (or did not) overflow."""
        if not self.dynamic:
            return
        if overflow:
            self._clean_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self._overflows_left = self.hysteresis
        else:
            self._clean_steps += 1
            if self._clean_steps % self.window == 0:
                self.scale *= 2.0
                self._overflows_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "overflows_left": self._overflows_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._overflows_left = int(state["overflows_left"])
