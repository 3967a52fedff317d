"""The chunk loops of fused linear cross entropy (see fused_linear_cross_entropy.py): forward
(loss, lse and, when asked, the gradients) and backward (recomputing each chunk's logits), on
plain local tensors; vocab parallelism passes its process group and vocab offset."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtmega.kernels.cross_entropy_rows import _grad_logits_, _rows_forward

# A chunk's fp32 logits take at most this many bytes: chunk_size = max(1, 256 MiB // (4 * V))
# tokens (V the local vocab: V / tp under vocab parallelism), e.g. 2048 tokens at V = 32768,
# 512 at V = 128K. Large enough that the matmuls run at full speed, small next to activations.
CHUNK_LOGITS_BYTES = 256 * 2**20


def default_chunk_size(vocab: int) -> int:
    """Tokens per chunk so that a chunk's fp32 logits [chunk, vocab] fit CHUNK_LOGITS_BYTES."""
    return max(1, CHUNK_LOGITS_BYTES // (4 * max(vocab, 1)))


def _check(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    if isinstance(hidden, DTensor) != isinstance(weight, DTensor):
        raise ValueError("hidden and weight must both be DTensors or both plain tensors (or weight vocab-sharded)")
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden [N, D] and weight [V, D], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} != [N] = [{hidden.shape[0]}]")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")



@dataclass(frozen=True)
class _Options:
    ignore_index: int
    chunk_size: int
    z_loss: float
    impl: str




# ---------------------------------------------------------------------------------------------
# The chunk loops, shared by the custom ops (group None) and the vocab-parallel Function.


def _logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    logits = torch.mm(h, weight.t())
    return logits if logits.dtype == torch.float32 else logits.float()


def _project_back(grad_logits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                  grad_h: torch.Tensor, grad_weight: torch.Tensor) -> None:
    """grad_h = grad_logits @ W (written in place), grad_weight += grad_logits.T @ h."""
    g = grad_logits.to(h.dtype)
    torch.mm(g, weight, out=grad_h)
    grad_weight.addmm_(g.t(), h)


def _chunks(n: int, size: int):
    """Slices of `size` rows covering 0..n."""
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def _gradient_buffers(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_hidden (written chunk by chunk) and grad_weight (accumulated over chunks: zeros)."""
    return (torch.empty(hidden.shape, device=hidden.device, dtype=hidden.dtype),
            torch.zeros(weight.shape, device=weight.device, dtype=weight.dtype))


def _forward(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor | None,
    opts: _Options, compute_grad: bool, group: dist.ProcessGroup | None = None, vocab_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss [N], lse [N], grad_hidden, grad_weight); the gradients (of sum scale_i * loss_i)
    only if compute_grad. Under vocab parallelism grad_hidden is this rank's partial sum."""
    n = hidden.shape[0]
    loss = torch.empty(n, device=hidden.device, dtype=torch.float32)
    lse = torch.empty(n, device=hidden.device, dtype=torch.float32)
    grad_hidden, grad_weight = _gradient_buffers(hidden, weight) if compute_grad else (None, None)
    for rows in _chunks(n, opts.chunk_size):
        h = hidden[rows]
        logits = _logits(h, weight)
        loss[rows], lse[rows] = _rows_forward(
            logits, labels[rows], scale[rows] if compute_grad else None, opts, group, vocab_start)
        if compute_grad:
            _project_back(logits, h, weight, grad_hidden[rows], grad_weight)
    return loss, lse, grad_hidden, grad_weight


def _backward(
    grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
    lse: torch.Tensor, opts: _Options, vocab_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of sum grad_loss_i * loss_i, recomputing each chunk's logits (lse is known)."""
    n = hidden.shape[0]
    grad_loss = grad_loss.float().contiguous()
    grad_hidden, grad_weight = _gradient_buffers(hidden, weight)
    for rows in _chunks(n, opts.chunk_size):
        h = hidden[rows]
        logits = _logits(h, weight)
        _grad_logits_(logits, labels[rows], lse[rows], grad_loss[rows], opts, vocab_start)
        _project_back(logits, h, weight, grad_hidden[rows], grad_weight)
    return grad_hidden, grad_weight


