"""Next-token choice: filters, the draw's distribution, and the margins the plan-equivalence
tests use to tell a near tie from a real divergence."""

from __future__ import annotations

import torch

from dtmega.train.sampling import choose_next, sample_next


def test_sampling_filters():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    assert sample_next(logits, temperature=0, top_k=0, top_p=1, generator=None).item() == 1
    g = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, temperature=1.0, top_k=2, top_p=1.0, generator=g).item() for _ in range(200)}
    assert picks == {1, 2}
    picks = {sample_next(logits, temperature=1.0, top_k=0, top_p=0.5, generator=g).item() for _ in range(100)}
    assert picks == {1}


def test_draws_follow_the_softmax():
    logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(1)) * 2
    expected = logits.softmax(-1)[0]
    g = torch.Generator().manual_seed(2)
    draws = 20000
    counts = torch.bincount(torch.cat([sample_next(logits.expand(100, -1), temperature=1.0, top_k=0, top_p=1.0,
                                                   generator=g) for _ in range(draws // 100)]), minlength=6)
    # Binomial standard deviation per token is sqrt(p(1-p)/n) <= 0.0036 at n = 20000: 5 sigma.
    assert (counts / draws - expected).abs().max() < 0.018, (counts / draws, expected)


def test_margins_measure_how_close_a_choice_was_to_flipping():
    greedy = choose_next(torch.tensor([[1.0, 3.0, 2.5]]), temperature=0, top_k=0, top_p=1, generator=None)
    assert greedy.ids.item() == 1 and abs(greedy.margins.item() - 0.5) < 1e-6
    # Two equally likely tokens: the cumulative distribution's inner boundary is at 0.5.
    g = torch.Generator().manual_seed(3)
    choice = choose_next(torch.zeros(1, 2), temperature=1.0, top_k=0, top_p=1, generator=g)
    draw = torch.rand(1, generator=torch.Generator().manual_seed(3)).item()
    assert choice.ids.item() == (0 if draw < 0.5 else 1)
    assert abs(choice.margins.item() - min(abs(draw - 0.5), draw, 1 - draw)) < 1e-6
