"""LR schedules (Megatron semantics), AdamW groups, gradient norm, loss scaling, sampling."""

from __future__ import annotations

import math

import pytest
import torch

from dtmega.train.optim import LossScaler, adamw, global_grad_norm
from dtmega.train.schedule import ParamSchedule


def test_warmup_then_decay_styles():
    """In samples, as Megatron counts them."""
    linear = ParamSchedule(0.0, 1.0, 0.1, warmup_steps=10, decay_steps=110, style="linear")
    assert linear.lr(5) == 0.5 and linear.lr(10) == 1.0 and math.isclose(linear.lr(60), 0.55) and linear.lr(111) == 0.1
    cosine = ParamSchedule(0.0, 1.0, 0.0, 0, 100, "cosine")
    assert math.isclose(cosine.lr(50), 0.5) and math.isclose(cosine.lr(100), 0.0, abs_tol=1e-12)
    assert ParamSchedule(0.0, 1.0, 0.0, 5, 100, "constant").lr(80) == 1.0
    wsd = ParamSchedule(0.0, 1.0, 0.0, 0, 100, "WSD", wsd_decay_steps=20, wsd_style="linear")
    assert wsd.lr(80) == 1.0 and math.isclose(wsd.lr(90), 0.5) and math.isclose(wsd.lr(100), 0.0, abs_tol=1e-12)
    with pytest.raises(ValueError, match="must be longer than its warmup"):
        ParamSchedule(0.0, 1.0, 0.0, 100, 50, "cosine")


def test_adamw_spares_norms_and_biases():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = adamw(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    decayed, spared = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and len(decayed["params"]) == 1
    assert spared["weight_decay"] == 0.0 and len(spared["params"]) == 3


def test_global_grad_norm_matches_torch():
    model = torch.nn.Linear(8, 8)
    model(torch.randn(3, 8)).square().sum().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert math.isclose(global_grad_norm(model.parameters()), float(expected), rel_tol=1e-6)


def test_dynamic_loss_scale_halves_after_hysteresis_and_grows_after_window():
    scaler = LossScaler(scale=1024.0, window=3, hysteresis=2)
    scaler.update(overflow=True)
    assert scaler.scale == 1024.0
    scaler.update(overflow=True)
    assert scaler.scale == 512.0
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 1024.0
    static = LossScaler(scale=8.0, dynamic=False)
    static.update(overflow=True)
    assert static.scale == 8.0
