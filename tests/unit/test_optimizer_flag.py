"""Megatron's --optimizer adam|sgd and --sgd-momentum.

The update rule is checked against the formula on fresh random values (one step on a plain model,
1e-6: fp32 arithmetic of a few terms); then a real run: `dtmega train --optimizer sgd` trains,
resumes from its checkpoint with the uninterrupted losses (momentum buffers restored), and a
resume asking for the other optimizer is refused naming the fix, or taken with --no-load-optim."""

from __future__ import annotations

import pytest
import torch

from dtmega.train.args import parse_train_args
from dtmega.train.checkpoint import CheckpointError, resolve_checkpoint
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3, bias=False))


def test_sgd_is_momentum_sgd_with_l2_decay_on_matrices_only():
    args = parse_train_args(["--optimizer", "sgd", "--sgd-momentum", "0.7", "--lr", "0.1", "--weight-decay", "0.2"])[0]
    model = _model(seed=int(torch.randint(0, 10_000, ())))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = args.make_optimizer(model)
    assert isinstance(optimizer, torch.optim.SGD)
    grads, after = {}, {}
    for step in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        grads[step] = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        after[step] = {name: p.detach().clone() for name, p in model.named_parameters()}
    after_first = after[0]
    for name, p in model.named_parameters():
        decay = 0.2 if p.ndim > 1 else 0.0
        first = grads[0][name] + decay * before[name]  # torch's SGD: momentum buffer = first gradient
        expected_first = before[name] - 0.1 * first
        torch.testing.assert_close(after_first[name], expected_first, rtol=1e-6, atol=1e-6)
        second = 0.7 * first + grads[1][name] + decay * expected_first
        torch.testing.assert_close(p.detach(), expected_first - 0.1 * second, rtol=1e-6, atol=1e-6)


def test_adam_is_adamw_by_default():
    args = parse_train_args([])[0]
    assert args.optimizer == "adam" and isinstance(args.make_optimizer(_model(0)), torch.optim.AdamW)


@pytest.fixture(scope="module")
def sgd_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sgd")
    corpus = prepare_corpus(root, documents=120)
    argv = tiny_args(corpus, train_iters=6, save_interval=3, save=str(root / "ckpt"), eval_iters=0, log_interval=1,
                     optimizer="sgd", sgd_momentum=0.8, lr=0.05, min_lr=0.005)
    return corpus, root / "ckpt", train(argv).losses


def test_an_sgd_run_trains_and_resumes_with_its_losses(sgd_run, tmp_path):
    corpus, save, losses = sgd_run
    assert len(losses) == 6 and losses[-1] < losses[0]
    again = train(tiny_args(corpus, train_iters=6, load=str(resolve_checkpoint(save).parent / "iter_0000003"),
                            save=str(tmp_path / "again"), eval_iters=0, log_interval=1, optimizer="sgd",
                            sgd_momentum=0.8, lr=0.05, min_lr=0.005))
    # a resume restores weights, momentum buffers, data position and RNG: the same sums in the same order
    assert again.losses == pytest.approx(losses[3:], rel=1e-5)


def test_resuming_with_the_other_optimizer_is_refused_naming_the_fix(sgd_run, tmp_path):
    corpus, save, _ = sgd_run
    with pytest.raises(CheckpointError, match=r"--optimizer sgd.*--optimizer adam.*Fix: --optimizer sgd.*--no-load-optim"):
        train(tiny_args(corpus, train_iters=6, load=str(save), save=str(tmp_path / "other"), eval_iters=0))
    switched = train(tiny_args(corpus, train_iters=8, load=str(save), save=str(tmp_path / "other"), eval_iters=0,
                               no_load_optim=True, log_interval=1))
    assert switched.iteration == 8 and len(switched.losses) == 2  # steps 7 and 8 by a fresh AdamW


def test_sgd_momentum_outside_0_1_is_refused():
    from dtmega.train.args import ArgumentError

    with pytest.raises(ArgumentError, match="--sgd-momentum"):
        parse_train_args(["--optimizer", "sgd", "--sgd-momentum", "1.5"])
