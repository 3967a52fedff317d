"""Ranks launched with different arguments (issue 18): one all-gather of a digest before any
work; every rank raises the same error naming the ranks and the settings that differ."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dtmega.train.args import ArgumentError
from dtmega.train.watch import check_same_arguments


def _settings(lr: float) -> dict:
    return {"args": {"lr": lr, "train_iters": 20, "data_path": ["d"]}, "plan": "[tp]", "world_size": 4}


def test_identical_arguments_pass():
    check_same_arguments(_settings(1e-3))


def test_differing_arguments_are_named_on_every_rank():
    rank = dist.get_rank()
    with pytest.raises(ArgumentError) as caught:
        check_same_arguments(_settings(2e-3 if rank in (1, 2) else 1e-3))
    message = str(caught.value)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, message)
    assert len(set(everyone)) == 1
    assert "ranks 1-2: args.lr = 0.002 (rank 0: 0.001)" in message and "nothing ran" in message


@pytest.mark.parametrize("what", ["plan", "torch"])
def test_a_rank_with_another_plan_or_torch_version_is_named_on_every_rank(what):
    """docs/reliability.md (start-up, Hang-free launches): the launch's own settings
    (`launch_settings`: arguments, plan, world, versions) are compared; a rank with another plan
    or another torch is named, with the setting, by the same error on every rank."""
    import torch

    from dtmega.train.watch import launch_settings

    settings = launch_settings({"lr": 1e-3}, "[tensor_parallel]")
    check_same_arguments(settings)
    odd = dist.get_world_size() - 1
    if dist.get_rank() == odd:
        settings[what] = "[data_parallel]" if what == "plan" else torch.__version__ + "+other"
    with pytest.raises(ArgumentError) as caught:
        check_same_arguments(settings)
    message = str(caught.value)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, message)
    assert len(set(everyone)) == 1
    assert f"rank {odd}: {what} = " in message and "nothing ran" in message, message
