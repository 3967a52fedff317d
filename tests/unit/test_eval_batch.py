"""--eval-global-batch-size and --eval-micro-batch-size (Megatron's): validation reads batches of
another size than training's, the validation split is sized by them (Megatron's
get_train_valid_test_num_samples), and sizes that do not split over the ranks or the pipeline
schedule are refused at start-up."""

from __future__ import annotations

import pytest

from dtmega.train.args import ArgumentError, parse_train_args
from dtmega.train.eval_batch import eval_batch
from dtmega.train.run_data import sample_counts
from dtmega.train.setup import build_plan, run_shape
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("corpus"), documents=120)


def test_one_validation_batch_of_four_reads_what_two_batches_of_two_read(corpus):
    """Training is the same (global batch 2) in both runs; one validation batch of 4 sequences in
    micro-batches of 2 reads the validation split's first 4 samples, as 2 batches of the
    training's size do, and the split is built for the same 2 x 4 samples: the same validation
    losses (token-weighted means of the same tokens; 1e-5: fp32 sums in another grouping). Were
    --eval-global-batch-size ignored, the second run would read 2 samples, not 4."""
    common = dict(train_iters=4, eval_interval=2, global_batch_size=2, micro_batch_size=1, lr_warmup_iters=1)
    two = train(tiny_args(corpus, eval_iters=2, **common))
    one = train(tiny_args(corpus, eval_iters=1, eval_global_batch_size=4, eval_micro_batch_size=2, **common))
    assert [step for step, _ in one.validation] == [step for step, _ in two.validation] == [2, 4]
    for (_, a), (_, b) in zip(one.validation, two.validation):
        assert a == pytest.approx(b, rel=1e-5)
    assert one.losses == pytest.approx(two.losses, rel=1e-6)


def test_the_validation_split_is_sized_by_the_validation_batch():
    args, _ = parse_train_args(["--train-iters", "100", "--eval-interval", "50", "--eval-iters", "3",
                                "--eval-global-batch-size", "16", "--global-batch-size", "8"])
    assert sample_counts(args, 8) == {"train": 800, "valid": 3 * 3 * 16}


def test_sizes_that_do_not_split_are_refused_at_start_up():
    args, _ = parse_train_args(["--num-layers", "2", "--global-batch-size", "8", "--micro-batch-size", "1",
                                "--eval-global-batch-size", "6", "--eval-micro-batch-size", "2"])
    with pytest.raises(ArgumentError, match="--eval-global-batch-size 6 is not divisible by --eval-micro-batch-size 2 "
                                            "x data-parallel size 2"):
        eval_batch(args, run_shape(args, world=2))
    args, _ = parse_train_args(["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                                "--micro-batch-size", "1", "--eval-global-batch-size", "1"])
    shape = run_shape(args, world=2)
    with pytest.raises(ArgumentError, match="= 1 validation micro-batches per rank: .*at least as many micro-batches "
                                            "as stages"):
        eval_batch(args, shape, build_plan(args, shape, 4))
    args, _ = parse_train_args(["--num-layers", "4", "--global-batch-size", "8", "--micro-batch-size", "2"])
    untouched = eval_batch(args, run_shape(args, world=2))  # the training's batch and split
    assert (untouched.global_batch, untouched.micro_batch, untouched.microbatches) == (8, 2, None)
