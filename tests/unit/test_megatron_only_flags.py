"""The Megatron-only flags taken with a meaning (megatron_only_args.py, --padded-vocab-size,
--logging-level): each builds what it says, and contradictions are refused naming the flag."""

from __future__ import annotations

import logging

import pytest

from dtmega.passes import DataParallel
from dtmega.train.args import ArgumentError, parse_train_args
from dtmega.train.setup import build_plan, model_config, run_shape
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args

SIZES = ["--swiglu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


def _data_parallel(flags: list[str]) -> DataParallel:
    args = parse_train_args([*SIZES, *flags])[0]
    plan = build_plan(args, run_shape(args, 4), 2)
    return next(p for p in plan.passes if isinstance(p, DataParallel))


@pytest.mark.parametrize("flags, mode, reduce", [
    (["--use-megatron-fsdp"], "fsdp", "float32"),  # Megatron's default strategy, optim_grads_params
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"], "fsdp", "float32"),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard"], "ddp", "float32"),
    (["--use-megatron-fsdp", "--megatron-fsdp-grad-comm-dtype", "bf16"], "fsdp", "bfloat16"),
    (["--use-megatron-fsdp", "--megatron-fsdp-main-grads-dtype", "fp32", "--dist-ckpt-strictness", "raise_all"],
     "fsdp", "float32"),
])
def test_megatron_fsdp_is_fsdp2(flags, mode, reduce):
    data_parallel = _data_parallel(flags)
    assert (data_parallel.mode, data_parallel.reduce_dtype) == (mode, reduce)


@pytest.mark.parametrize("flags, message", [
    (["--data-parallel-sharding-strategy", "no_shard"], r"needs --use-megatron-fsdp"),
    (["--use-megatron-fsdp", "--data-parallel", "ddp"], r"asks for fsdp and --data-parallel for ddp. Fix: keep one"),
])
def test_megatron_fsdp_contradictions_are_refused(flags, message):
    with pytest.raises(ArgumentError, match=message):
        _data_parallel(flags)


def test_padded_vocab_size_is_the_models_vocabulary():
    args = parse_train_args([*SIZES, "--padded-vocab-size", "300", "--tensor-model-parallel-size", "2"])[0]
    assert model_config(args, tokenizer_vocab=258).vocab_size == 300
    for bad in ("257", "301"):  # below the tokenizer's ids; not a multiple of TP 2
        args = parse_train_args([*SIZES, "--padded-vocab-size", bad, "--tensor-model-parallel-size", "2"])[0]
        with pytest.raises(ArgumentError, match=rf"--padded-vocab-size {bad} must be at least the tokenizer's 258"):
            model_config(args, tokenizer_vocab=258)


def test_logging_level_sets_every_loggers_level(tmp_path):
    root = logging.getLogger()
    before = root.level
    try:
        train(tiny_args(prepare_corpus(tmp_path, documents=60), train_iters=1, eval_iters=0, logging_level=40))
        assert root.level == 40
    finally:
        root.setLevel(before)
