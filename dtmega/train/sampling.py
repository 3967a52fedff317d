"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Every choice also reports its *margin*, how far it was from going the other way: for greedy
decoding the gap between the best and the runner-up logit, for sampling the distance of the
uniform draw from the nearest boundary of the cumulative distribution. Two runs of the same
model under different plans (other reduction orders, so logits that differ in the last bits)
must make the same choices wherever the margin is above that roundoff; the tests use it to
tell a real divergence from a near tie.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Choice(NamedTuple):
    """Next token ids [B] and the margin of each choice [B] (see the module docstring)."""

    ids: torch.Tensor
    margins: torch.Tensor


def filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """`logits` [B, V] with everything outside the top-k tokens and outside the smallest set
    whose probability reaches top-p set to -inf (top_k=0 / top_p=1: no filter)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def choose_next(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> Choice:
    """Next token ids from last-position logits [B, V]: greedy at temperature 0, else a draw
    from softmax(logits / temperature) restricted by top-k and top-p (inverse-CDF sampling with
    one uniform number per row from `generator`, so the same seed draws the same tokens)."""
    logits = logits.float()
    if temperature <= 0:
        top2 = torch.topk(logits, min(2, logits.shape[-1])).values
        gap = top2[:, 0] - top2[:, 1] if top2.shape[-1] > 1 else torch.full_like(top2[:, 0], float("inf"))
        return Choice(logits.argmax(dim=-1), gap)
    scaled = logits / temperature
    probs = filter_logits(scaled, top_k=top_k, top_p=top_p).softmax(-1)
    cdf = probs.cumsum(-1)
    draw = torch.rand(logits.shape[0], 1, generator=generator, device=logits.device) * cdf[:, -1:]
    ids = torch.searchsorted(cdf, draw, right=True).clamp(max=logits.shape[-1] - 1)
    upper = cdf.gather(-1, ids)
    lower = torch.where(ids > 0, cdf.gather(-1, (ids - 1).clamp(min=0)), torch.zeros_like(upper))
    margins = torch.minimum(draw - lower, upper - draw)
    # A temperature so small that logits / temperature overflow (1e-300) made the softmax NaN and
    # the search land on the vocabulary's padding rows (matrix 3, H13). Its limit is greedy: such
    # rows take the argmax, which never picks a row masked to -inf.
    limit = (torch.isfinite(logits) & ~torch.isfinite(scaled)).any(-1) | ~torch.isfinite(cdf[:, -1])
    if bool(limit.any()):
        greedy = choose_next(logits, temperature=0.0, top_k=0, top_p=1.0, generator=None)
        return Choice(torch.where(limit, greedy.ids, ids.squeeze(-1)),
                      torch.where(limit, greedy.margins, margins.squeeze(-1)))
    return Choice(ids.squeeze(-1), margins.squeeze(-1))


def sample_next(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids [B] (`choose_next` without the margins)."""
    return choose_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator).ids
