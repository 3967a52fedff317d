"""--async-save (Megatron's flag, DCP's async_save): the interval checkpoints are written in the
background while training goes on, and are the same checkpoints.

Against the synchronous run of the same line (fresh corpus, same seed): the losses are equal and
every tensor of every checkpoint is bitwise equal (the write path changes no arithmetic, and DCP
copies the shards to host memory before training touches them again); a resume from a
background-written checkpoint repeats the uninterrupted losses. With a writer slowed down, the
next step's loss is logged before the checkpoint is published: the step went on while it wrote.
A distributed twin runs on 2 gloo ranks in tests/distributed/test_async_save_ranks.py."""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtmega.checkpoint_reader import load_dcp, read_dcp_metadata
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args


def read_tensors(checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, read as data."""
    template = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
                for key, meta in read_dcp_metadata(checkpoint).state_dict_metadata.items()
                if isinstance(meta, TensorStorageMetadata)}
    load_dcp(template, checkpoint, no_dist=True)
    return template


def _argv(corpus, save, **flags):
    return tiny_args(corpus, train_iters=8, save_interval=2, save=str(save), eval_iters=0, log_interval=1, **flags)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_save")
    corpus = prepare_corpus(root, documents=120)
    background = train(_argv(corpus, root / "background", async_save=True))
    in_place = train(_argv(corpus, root / "in_place"))
    return corpus, root, background, in_place


def test_the_losses_and_every_checkpoint_equal_the_synchronous_run(runs):
    _, root, background, in_place = runs
    assert background.losses == in_place.losses
    for step in (2, 4, 6, 8):
        name = f"iter_{step:07d}"
        ours, theirs = read_tensors(root / "background" / name), read_tensors(root / "in_place" / name)
        assert sorted(ours) == sorted(theirs) and any(key.startswith("optimizer.") for key in ours)
        for key, tensor in ours.items():
            assert torch.equal(tensor, theirs[key]), (name, key)
    assert (root / "background" / "latest").read_text().strip() == "iter_0000008"
    assert not list((root / "background").glob(".*.partial"))


def test_a_resume_from_a_background_checkpoint_repeats_the_losses(runs, tmp_path):
    corpus, root, background, _ = runs
    again = train(tiny_args(corpus, train_iters=8, load=str(root / "background" / "iter_0000004"),
                            save=str(tmp_path / "again"), eval_iters=0, log_interval=1))
    assert again.losses == pytest.approx(background.losses[4:], rel=1e-6)  # same sums in the same order


def test_training_goes_on_while_the_checkpoint_is_written(runs, tmp_path, monkeypatch, capsys):
    corpus = runs[0]
    write = _FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        time.sleep(1.5)  # long beside a step of this model (~0.05 s): the next steps run meanwhile
        return write(self, plan, planner)

    monkeypatch.setattr(_FileSystemWriter, "write_data", slow_write)
    capsys.readouterr()
    train(tiny_args(corpus, train_iters=6, save_interval=2, save=str(tmp_path / "slow"), eval_iters=0,
                    log_interval=1, async_save=True))
    out = capsys.readouterr().out
    started = out.index("saving checkpoint")
    published = out.index("saved checkpoint", started)
    between = out[started:published]
    assert "iter_0000002 in the background" in out[started:started + 200]
    # the step after the save logged its row before the checkpoint was published
    assert any(line.split()[:1] == ["3"] for line in between.splitlines()), between
    assert "(written in the background)" in out[published:published + 200]
