"""Row-wise cross entropy on one chunk's fp32 logits [n, V]: the PyTorch reference and the
Triton kernels (one program per row, online max / sum-exp over vocab blocks), used by fused
linear cross entropy's chunk loops."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dtmega.kernels.triton_support import kernel_factory, launch, num_warps_for, wants_triton

if TYPE_CHECKING:
    from dtmega.kernels.linear_cross_entropy_core import _Options

# ---------------------------------------------------------------------------------------------
# Row-wise cross entropy on one chunk's fp32 logits [n, V]: reference and Triton.


def _rows_forward(
    logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor | None, opts: _Options,
    group: dist.ProcessGroup | None, vocab_start: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) of each row; with `scale`, also overwrites logits with grad_logits."""
    triton = wants_triton(opts.impl, logits)
    if group is None and triton:
        return _rows_forward_triton(logits, labels, scale, opts)
    valid = labels != opts.ignore_index
    if group is None:
        lse = torch.logsumexp(logits, dim=-1)
        target = logits.gather(1, torch.where(valid, labels, 0).unsqueeze(1)).squeeze(1)
    else:  # local statistics, then loss_parallel's reductions across the vocab shards
        stats = _rows_stats_triton if triton else _rows_stats_reference
        row_max, sumexp, target = stats(logits, labels, vocab_start)
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        sums = torch.stack([sumexp * torch.exp(row_max - global_max), target])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse = global_max + torch.log(sums[0])
        target = sums[1]
    loss = torch.where(valid, lse - target + opts.z_loss * lse * lse, 0.0)
    if scale is not None:
        _grad_logits_(logits, labels, lse, scale, opts, vocab_start)
    return loss, lse


def _rows_stats_reference(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This shard's row max, sum of exp(logits - max), and target logit (0 if another's)."""
    row_max = logits.max(dim=-1).values
    sumexp = torch.exp(logits - row_max.unsqueeze(1)).sum(-1)
    local = labels - vocab_start
    inside = (local >= 0) & (local < logits.shape[1])
    target = logits.gather(1, torch.where(inside, local, 0).unsqueeze(1)).squeeze(1)
    return row_max, sumexp, torch.where(inside, target, 0.0)


def _grad_logits_(
    logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, opts: _Options,
    vocab_start: int,
) -> None:
    """Overwrites logits with scale_i * (softmax * (1 + 2 z lse) - onehot), 0 on ignored rows."""
    if wants_triton(opts.impl, logits):
        _grad_logits_triton_(logits, labels, lse, scale, opts, vocab_start)
        return
    valid = labels != opts.ignore_index
    factor = torch.where(valid, scale.float(), 0.0)
    logits.sub_(lse.unsqueeze(1)).exp_().mul_((factor * (1 + 2 * opts.z_loss * lse)).unsqueeze(1))
    local = labels - vocab_start
    inside = valid & (local >= 0) & (local < logits.shape[1])
    logits.scatter_add_(1, torch.where(inside, local, 0).unsqueeze(1), -torch.where(inside, factor, 0.0).unsqueeze(1))


def _block(vocab: int) -> int:
    import triton

    return min(triton.next_power_of_2(vocab), 4096)


@kernel_factory
def _kernels():
    global tl, _row_max_sumexp, _row_grad  # kernels resolve names in the module's globals (see kernel_factory)
    import triton
    import triton.language as tl

    @triton.jit
    def _row_max_sumexp(row_ptr, n_cols, BLOCK: tl.constexpr):
        """Online max and sum of exp(x - max) over one row, BLOCK columns at a time."""
        m = float("-inf")
        d = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        return m, d

    @triton.jit
    def _row_grad(row_ptr, n_cols, lse, label, factor, coef, BLOCK: tl.constexpr):
        """Overwrites the row with factor * (exp(x - lse) * coef - onehot(label))."""
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(row_ptr + cols, mask=mask, other=0.0)
            grad = tl.exp(x - lse) * coef - tl.where(cols == label, 1.0, 0.0)
            tl.store(row_ptr + cols, factor * grad, mask=mask)

    @triton.jit
    def forward(logits_ptr, labels_ptr, scale_ptr, loss_ptr, lse_ptr, n_cols, ignore_index, z_loss,
                COMPUTE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * n_cols
        label = tl.load(labels_ptr + row)
        valid = label != ignore_index
        m, d = _row_max_sumexp(row_ptr, n_cols, BLOCK)
        lse = m + tl.log(d)
        target = tl.load(row_ptr + label, mask=valid, other=0.0)
        tl.store(loss_ptr + row, tl.where(valid, lse - target + z_loss * lse * lse, 0.0))
        tl.store(lse_ptr + row, lse)
        if COMPUTE_GRAD:
            factor = tl.where(valid, tl.load(scale_ptr + row).to(tl.float32), 0.0)
            _row_grad(row_ptr, n_cols, lse, label, factor, 1.0 + 2.0 * z_loss * lse, BLOCK)

    @triton.jit
    def stats(logits_ptr, labels_ptr, max_ptr, sumexp_ptr, target_ptr, n_cols, vocab_start,
              BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * n_cols
        local = tl.load(labels_ptr + row) - vocab_start
        m, d = _row_max_sumexp(row_ptr, n_cols, BLOCK)
        inside = (local >= 0) & (local < n_cols)
        tl.store(max_ptr + row, m)
        tl.store(sumexp_ptr + row, d)
        tl.store(target_ptr + row, tl.load(row_ptr + local, mask=inside, other=0.0))

    @triton.jit
    def grad(logits_ptr, labels_ptr, lse_ptr, scale_ptr, n_cols, vocab_start, ignore_index, z_loss,
             BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        label = tl.load(labels_ptr + row)
        lse = tl.load(lse_ptr + row)
        factor = tl.where(label != ignore_index, tl.load(scale_ptr + row).to(tl.float32), 0.0)
        _row_grad(logits_ptr + row * n_cols, n_cols, lse, label - vocab_start, factor,
                 1.0 + 2.0 * z_loss * lse, BLOCK)

    return forward, stats, grad


def _rows_forward_triton(
    logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor | None, opts: _Options
) -> tuple[torch.Tensor, torch.Tensor]:
    forward, _, _ = _kernels()
    n, vocab = logits.shape
    loss = torch.empty(n, device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(loss)
    block = _block(vocab)
    if n:
        launch("cross_entropy_forward", forward, (n,), logits, labels.contiguous(),
               scale.float().contiguous() if scale is not None else lse, loss, lse, vocab, opts.ignore_index,
               opts.z_loss, COMPUTE_GRAD=scale is not None, BLOCK=block, num_warps=num_warps_for(block))
    return loss, lse


def _rows_stats_triton(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, stats, _ = _kernels()
    n, vocab = logits.shape
    row_max, sumexp, target = torch.empty(3, n, device=logits.device, dtype=torch.float32)
    block = _block(vocab)
    if n:
        launch("cross_entropy_stats", stats, (n,), logits, labels.contiguous(), row_max, sumexp, target, vocab,
               vocab_start, BLOCK=block, num_warps=num_warps_for(block))
    return row_max, sumexp, target


def _grad_logits_triton_(
    logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, opts: _Options,
    vocab_start: int,
) -> None:
    _, _, grad = _kernels()
    n, vocab = logits.shape
    block = _block(vocab)
    if n:
        launch("cross_entropy_grad", grad, (n,), logits, labels.contiguous(), lse.contiguous(),
               scale.float().contiguous(), vocab, vocab_start, opts.ignore_index, opts.z_loss,
               BLOCK=block, num_warps=num_warps_for(block))


