"""--async-save on 4 gloo ranks (TP2 x FSDP2): the background writer's collectives run on their
own group beside the training's, and the result equals the synchronous run: the same losses and,
in every checkpoint, bitwise the same tensors (tests/unit/test_async_save.py has the one-rank
checks, the resume and the overlap)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.train_helpers import tiny_args
from tests.train_helpers import train_reusing_meshes as train
from tests.unit.test_async_save import read_tensors


def test_async_save_on_four_ranks_equals_the_synchronous_run(corpus, shared_dir):
    def run(name: str, **flags):
        return train(tiny_args(corpus, train_iters=6, save_interval=2, save=shared_dir / name, eval_iters=0,
                               log_interval=1, tensor_model_parallel_size=2, sequence_parallel=True,
                               use_distributed_optimizer=True, **flags))

    background, in_place = run("async_tp2_fsdp2", async_save=True), run("sync_tp2_fsdp2")
    assert background.losses == in_place.losses  # the write path changes no arithmetic
    if dist.get_rank() == 0:
        for step in (2, 4, 6):
            name = f"iter_{step:07d}"
            ours = read_tensors(shared_dir / "async_tp2_fsdp2" / name)
            theirs = read_tensors(shared_dir / "sync_tp2_fsdp2" / name)
            assert sorted(ours) == sorted(theirs)
            for key, tensor in ours.items():
                assert torch.equal(tensor, theirs[key]), (name, key)
    dist.barrier()
