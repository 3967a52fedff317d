"""`--save-retain-interval N` (Megatron's): each save deletes the previous latest checkpoint unless
its step is a multiple of N, so the newest and every N-th remain."""

from __future__ import annotations

import pytest
import torch

from dtmega.train.args import ArgumentError, parse_train_args
from dtmega.train.checkpoint import SaveInProgress
from dtmega.train.setup import reject_unsupported


def test_only_the_newest_and_every_nth_checkpoint_remain(tmp_path, one_rank_mesh):
    model = torch.nn.Linear(2, 2)
    for step in range(1, 8):
        SaveInProgress.start(tmp_path, step, model, None, {"iteration": step}, retain_interval=3).finish()
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000003", "iter_0000006", "iter_0000007"]
    assert (tmp_path / "latest").read_text().strip() == "iter_0000007"


def test_without_the_flag_every_checkpoint_remains(tmp_path, one_rank_mesh):
    model = torch.nn.Linear(2, 2)
    for step in range(1, 4):
        SaveInProgress.start(tmp_path, step, model, None, {"iteration": step}).finish()
    assert len(list(tmp_path.glob("iter_*"))) == 3


def test_a_retain_interval_off_the_save_interval_is_refused():
    args, _ = parse_train_args(["--mock-data", "--save-interval", "4", "--save-retain-interval", "6"])
    with pytest.raises(ArgumentError, match=r"--save-retain-interval 6 is not a multiple of --save-interval 4"):
        reject_unsupported(args)
