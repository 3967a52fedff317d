"""`--deterministic-mode` and `--logging-level` (dtmega/train/process_settings.py): Megatron's CI
runs 220 of its 279 GPT/MoE functional tests with --deterministic-mode; here it turns torch's
deterministic algorithms on (an op without one raises naming itself) with cuBLAS's workspace."""

from __future__ import annotations

import logging
import os

import torch

from dtmega.train.args import parse_train_args
from dtmega.train.process_settings import apply_process_settings

LINE = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]


def test_deterministic_mode_turns_torchs_deterministic_algorithms_on(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    args, _ = parse_train_args([*LINE, "--deterministic-mode"])
    was = torch.are_deterministic_algorithms_enabled()
    try:
        apply_process_settings(args)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(was)


def test_without_the_flags_nothing_changes(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    args, _ = parse_train_args(LINE)
    level = logging.getLogger().level
    apply_process_settings(args)
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert logging.getLogger().level == level


def test_logging_level_sets_every_logger(monkeypatch):
    args, _ = parse_train_args([*LINE, "--logging-level", "40"])
    root = logging.getLogger()
    level = root.level
    try:
        apply_process_settings(args)
        assert root.level == 40
    finally:
        root.setLevel(level)
