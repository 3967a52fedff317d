"""One long-lived process group for the whole distributed suite.

Run as `torchrun --nproc-per-node 4 -m pytest tests/distributed`: every rank runs the same
pytest session, in the same order, and each test builds the mesh it needs with
`mesh(...)` (a world of 4 split into independent meshes for 1- and 2-rank plans).
"""

from __future__ import annotations

import os
from pathlib import Path
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.helpers import WORLD


def pytest_configure(config):
    if "WORLD_SIZE" not in os.environ:
        pytest.exit(
            "tests/distributed runs under torchrun: "
            "torchrun --nproc-per-node 4 -m pytest tests/distributed", returncode=2,
        )
    if not dist.is_initialized():
        # A short timeout turns a desynchronized collective into a failure, not a stalled CI.
        dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    if dist.get_world_size() != WORLD:
        pytest.exit(f"the distributed suite expects {WORLD} ranks, got {dist.get_world_size()}", returncode=2)


_FAILURES: list[str] = []


def pytest_runtest_logreport(report):
    if report.failed:
        _FAILURES.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    """Rank 0's console is the one shown: it lists what failed on any rank."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, _FAILURES)
    if dist.get_rank() == 0:
        threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else "?"
        print(f"\nthreads in rank 0 at the end (gloo keeps three per process group): {threads}")
        for rank, failures in enumerate(everyone):
            for nodeid in failures:
                print(f"\nrank {rank} failed: {nodeid}")
    if any(everyone):
        session.exitstatus = 1


@pytest.fixture(autouse=True)
def _lockstep():
    """Seeds every test alike on every rank and keeps ranks in step between tests."""
    torch.manual_seed(0)
    yield
    dist.barrier()


@pytest.fixture
def rank() -> int:
    return dist.get_rank()


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    """One directory every rank sees (rank 0 makes it; the path is broadcast)."""
    path = [str(tmp_path_factory.mktemp("shared")) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return Path(path[0])


@pytest.fixture(scope="session")
def corpus(shared_dir) -> str:
    """The trainer tests' small tokenized corpus (its --data-path), written once per session."""
    from tests.train_helpers import prepare_corpus

    return prepare_corpus(shared_dir)

