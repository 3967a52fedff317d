"""`--dist-ckpt-strictness` (Megatron's values, issue 51 item 5): which key mismatches stop a load
and which are logged. Megatron's CI runs 223 of its 279 GPT/MoE functional tests with log_all or
log_unexpected; before, any value but raise_all was refused."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from dtmega.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


class Two(nn.Module):
    def __init__(self, extra: bool = False):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 2)
        if extra:
            self.c = nn.Linear(2, 2)


@pytest.fixture
def saved(tmp_path, one_rank_mesh):
    torch.manual_seed(0)
    model = Two()
    save_checkpoint(tmp_path / "ckpt", 1, model, None, {"iteration": 1})
    return tmp_path / "ckpt", model


def test_raise_all_names_every_mismatch_before_any_read(saved):
    root, _ = saved
    with pytest.raises(CheckpointError, match=r"c.weight: in the model, not in the checkpoint(.|\n)*log_all loads"):
        load_checkpoint(root, Two(extra=True))
    with pytest.raises(CheckpointError, match=r"b.weight: in the checkpoint, not in the model"):
        load_checkpoint(root, nn.Sequential(nn.Linear(3, 3)))  # every saved key is unexpected


@pytest.mark.parametrize("strictness", ["log_all", "ignore_all", "return_all"])
def test_a_key_the_checkpoint_lacks_keeps_its_value_under_log_all(saved, strictness, caplog):
    root, original = saved
    torch.manual_seed(1)
    model = Two(extra=True)
    before = model.c.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="dtmega.checkpoint"):
        load_checkpoint(root, model, strictness=strictness)
    assert torch.equal(model.a.weight, original.a.weight) and torch.equal(model.b.bias, original.b.bias)
    assert torch.equal(model.c.weight, before)
    assert ("c.weight" in caplog.text) == (strictness == "log_all")


@pytest.mark.parametrize("strictness", ["log_unexpected", "raise_unexpected", "assume_ok_unexpected"])
def test_missing_keys_still_stop_the_unexpected_only_modes(saved, strictness):
    root, _ = saved
    with pytest.raises(CheckpointError, match="c.weight: in the model, not in the checkpoint"):
        load_checkpoint(root, Two(extra=True), strictness=strictness)


def test_unexpected_keys_are_logged_or_refused_by_mode(saved, caplog):
    root, original = saved

    class OnlyA(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)

    model = OnlyA()
    with caplog.at_level(logging.WARNING, logger="dtmega.checkpoint"):
        load_checkpoint(root, model, strictness="log_unexpected")
    assert torch.equal(model.a.weight, original.a.weight)
    assert "b.weight" in caplog.text and "were not read" in caplog.text
    with pytest.raises(CheckpointError, match="b.weight: in the checkpoint, not in the model"):
        load_checkpoint(root, OnlyA(), strictness="raise_unexpected")


def test_a_shape_mismatch_stops_every_mode(saved):
    root, _ = saved
    model = Two()
    model.b = nn.Linear(3, 4)
    with pytest.raises(CheckpointError, match=r"b.weight: checkpoint \(2, 3\) vs model \(4, 3\)"):
        load_checkpoint(root, model, strictness="ignore_all")


def test_missing_weights_cannot_resume_their_optimizer_state(saved):
    root, _ = saved
    model = Two(extra=True)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match=r"lacks 2 of the model's weights .* --no-load-optim"):
        load_checkpoint(root, model, optimizer, strictness="log_all")
