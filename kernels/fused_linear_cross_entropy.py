"""The output projection fused with cross entropy, in chunks of tokens: [N, V] logits never exist.

    loss_i = lse_i - logits_i[label_i] + z_loss * lse_i^2,    lse_i = logsumexp(logits_i),
    logits = hidden @ weight.T with fp32 accumulation (bf16: torch.mm in bf16, then .float()).

Tokens labelled `ignore_index` get loss 0 and zero gradient. Each chunk of `chunk_size` tokens
goes: logits = h_c @ W.T (torch.mm: cuBLAS), then one pass over the rows (a Triton program per
row with an online max / sum-exp over vocab blocks, or the PyTorch reference) that writes the
loss, lse and, in place of the chunk's logits, grad_logits = g_i * (softmax * (1 + 2 z lse) -
onehot), then grad_h_c = grad_logits @ W and grad_W += grad_logits.T @ h_c. Extra memory is one
chunk's fp32 logits, O(chunk_size x V), in both passes (Liger-Kernel's idea).

Two entry points:
* `fused_linear_cross_entropy` -> per-token losses [N]. Saves hidden, weight, labels and lse;
  backward recomputes each chunk's logits, so it is exact for any per-token grad_output
  (4 matmuls per chunk in all: the logits twice, then the two gradient products).
* `fused_linear_cross_entropy_sum` -> sum_i token_weights_i * loss_i. The weights are known up
  front, so forward computes grad_hidden and grad_weight chunk by chunk (3 matmuls per chunk,
  no recompute) and saves them; backward multiplies them by the scalar grad_output. What the
  training loop uses.
grad_weight accumulates over the chunks in the weight's dtype inside the GEMM (addmm: fp32
accumulation within a chunk's product, one rounding per chunk, as Liger does). An fp32
accumulator would add a pass over [V, D] fp32 per chunk: on an H100 at V = 128K, D = 4096 in
bf16 it made the fused loss 1.65x slower than the unfused one.

Bytes saved for backward, N tokens, V vocab, D hidden dim, s bytes per hidden/weight element:
* unfused `F.cross_entropy((h @ W.T).float(), labels, reduction="none")`: mm saves h and W,
  log_softmax its [N, V] fp32 output, nll_loss the labels and a scalar total weight:
  s (N + V) D + 4 N V + 8 N + 4.
* fused per-token: hidden, weight, labels, lse: s (N + V) D + 8 N + 4 N.
* fused sum: grad_hidden and grad_weight: s (N + V) D.
N = 4 x 2048, V = 32000, D = 256, fp32 (the test's case): unfused 1,089,798,148 B (1039 MiB),
per-token 41,254,912 B (39.3 MiB, 1/26.4 of it), sum 41,156,608 B (39.3 MiB, 1/26.5).

Vocab parallel (tensor parallelism): `weight` may be a DTensor sharded on dim 0 over a 1-D mesh,
with `hidden` a DTensor replicated on it (or a plain tensor: replicated). Each rank computes its
logits chunk [n, V / tp]; the row max (all-reduce MAX), the sum of exp (all-reduce SUM) and the
target logit (its owner's, all-reduce SUM) are reduced across the mesh, torch's `loss_parallel`
numerics. grad_weight comes back as this rank's vocab shard; grad_hidden as a Partial DTensor
(a preceding all-gather's backward reduce-scatters it), or all-reduced for a plain hidden.
Otherwise DTensors go through the custom ops' sharding rule: hidden, labels (and token weights)
sharded on the token dim with a replicated weight run locally (grad_weight Partial).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from dtmega.kernels import linear_cross_entropy_ops  # noqa: F401  (registers the dtmega:: ops)
from dtmega.kernels.linear_cross_entropy_core import (  # noqa: F401  (re-exported)
    CHUNK_LOGITS_BYTES,
    _check,
    default_chunk_size,
)
from dtmega.kernels.triton_support import check_impl
from dtmega.kernels.vocab_parallel_cross_entropy import _options, _VocabParallel


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
    chunk_size: int | None = None, z_loss: float = 0.0, impl: str = "auto",
) -> torch.Tensor:
    """Per-token losses [N] fp32 of logits = hidden [N, D] @ weight [V, D].T against labels [N],
    without materializing the logits (see the module docstring; weight may be vocab-sharded)."""
    check_impl(impl)
    if _vocab_sharded(weight):
        opts = _options(weight, ignore_index, chunk_size, z_loss, impl)
        return _VocabParallel.apply(hidden, weight, labels, None, opts)
    _check(hidden, weight, labels)
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    loss, _ = torch.ops.dtmega.linear_cross_entropy(hidden, weight, labels, ignore_index, chunk, float(z_loss), impl)
    return loss


def fused_linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, token_weights: torch.Tensor, *,
    ignore_index: int = -100, chunk_size: int | None = None, z_loss: float = 0.0, impl: str = "auto",
) -> torch.Tensor:
    """sum_i token_weights_i * loss_i, a scalar fp32; gradients are computed in the forward pass
    (when hidden or weight requires grad) and only scaled in backward."""
    check_impl(impl)
    if _vocab_sharded(weight):
        opts = _options(weight, ignore_index, chunk_size, z_loss, impl)
        return _VocabParallel.apply(hidden, weight, labels, token_weights, opts)
    _check(hidden, weight, labels)
    if token_weights.shape != labels.shape:
        raise ValueError(f"token_weights {tuple(token_weights.shape)} != labels {tuple(labels.shape)}")
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    total, _, _ = torch.ops.dtmega.linear_cross_entropy_sum(
        hidden, weight, labels, token_weights, ignore_index, chunk, float(z_loss), compute_grad, impl)
    return total


def _vocab_sharded(weight: torch.Tensor) -> bool:
    """True if weight is a DTensor sharded along some dim (the vocab-parallel path takes it)."""
    return isinstance(weight, DTensor) and any(isinstance(p, Shard) for p in weight.placements)


