"""One long-lived process group for the whole distributed suite.

Run as `torchrun --nproc-per-node 4 -m pytest tests/distributed`: every rank runs the same
pytest session, in the same order, and each test builds the mesh it needs with
`mesh(...)` (a world of 4 split into independent meshes for 1- and 2-rank plans).
"""

from __future__ import annotations

import faulthandler
import os
import tempfile
from datetime import timedelta
from pathlib import Path

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
    global _BETWEEN_TESTS
    _BETWEEN_TESTS = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))


# The barrier after every test. Ranks that skip a test run on the first copy only
# (tests.helpers.first_copy_mesh) wait here while the others work, which can take longer than
# the 90 s collective timeout: this group waits up to 10 minutes (pytest-timeout ends a test at 5).
_BETWEEN_TESTS = None


def pytest_sessionstart(session):
    """After pytest's own faulthandler set-up (it points the handler at stderr in its configure)."""
    _record_crashes(dist.get_rank())


CRASH_DIR = Path(os.environ.get("DTMEGA_TEST_CRASH_DIR", Path(tempfile.gettempdir()) / "dtmega-test-crashes"))


def _record_crashes(rank: int) -> None:
    """A rank that dies of a signal leaves its Python stacks in CRASH_DIR/rank<r>.txt: torchrun
    shows rank 0's console only (--local-ranks-filter 0), so another rank's crash would otherwise
    leave no trace. tests/distributed_session.py (`make test`) prints them when a rank dies."""
    CRASH_DIR.mkdir(parents=True, exist_ok=True)
    (CRASH_DIR / f"passed-rank{rank}.txt").write_text("")
    stacks = open(CRASH_DIR / f"rank{rank}.txt", "w")  # noqa: SIM115 (open for the process's life)
    faulthandler.enable(file=stacks, all_threads=True)


_FAILURES: list[str] = []


def pytest_runtest_logreport(report):
    if report.failed:
        _FAILURES.append(report.nodeid)
    elif report.when == "teardown" and report.nodeid not in _FAILURES:
        # What tests/distributed_session.py need not rerun should this session crash.
        with open(CRASH_DIR / f"passed-rank{dist.get_rank()}.txt", "a") as passed:
            passed.write(report.nodeid + "\n")


def pytest_collection_modifyitems(config, items):
    """A rerun after a native crash (tests/distributed_session.py) skips what passed on every
    rank before it; every rank reads the same file, so the ranks stay in step."""
    skip_file = os.environ.get("DTMEGA_TEST_SKIP_FINISHED")
    if not skip_file:
        return
    finished = set(Path(skip_file).read_text().splitlines())
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in finished])
    items[:] = [item for item in items if item.nodeid not in finished]


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
    dist.barrier(group=_BETWEEN_TESTS)


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

