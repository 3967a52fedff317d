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
from torch.distributed.device_mesh import init_device_mesh

from tests.helpers import WORLD


def pytest_configure(config):
    if "WORLD_SIZE" not in os.environ:
        pytest.exit(
            "tests/distributed runs under torchrun: "
            "torchrun --nproc-per-node 4 -m pytest tests/distributed", returncode=2,
        )
    if not dist.is_initialized():
        # A timeout turns a desynchronized collective into a failure, not a stalled CI. 240 s, under
        # pytest-timeout's 300: at 90 s a fresh clone's full session once failed
        # test_fp8_plans_equal_one_rank_in_float64[tp2_fsdp2_compiled-delayed] (86 s alone) when one
        # rank's Dynamo compile fell more than 90 s behind the others' on this 2-core machine.
        dist.init_process_group("gloo", timeout=timedelta(seconds=240))
    if dist.get_world_size() != WORLD:
        pytest.exit(f"the distributed suite expects {WORLD} ranks, got {dist.get_world_size()}", returncode=2)
    global _BETWEEN_TESTS
    _BETWEEN_TESTS = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))


# The barrier after every test. Ranks that skip a test run on the first copy only
# (tests.helpers.first_copy_mesh) wait here while the others work, which can take longer than
# the 240 s collective timeout: this group waits up to 10 minutes (pytest-timeout ends a test at 5).
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
    for kind in ("started", "passed", "failed"):  # the runner's record of this rank (_note)
        (CRASH_DIR / f"{kind}-rank{rank}.txt").write_text("")
    stacks = open(CRASH_DIR / f"rank{rank}.txt", "w")  # noqa: SIM115 (open for the process's life)
    faulthandler.enable(file=stacks, all_threads=True)


_FAILURES: list[str] = []


def _note(kind: str, nodeid: str) -> None:
    """Appends a test to this rank's CRASH_DIR/<kind>-rank<r>.txt, closed at once so that it
    survives a native crash: tests/distributed_session.py reads what started, passed and failed
    on every rank to judge a session that crashed (a failure before the crash fails the run)."""
    with open(CRASH_DIR / f"{kind}-rank{dist.get_rank()}.txt", "a") as record:
        record.write(nodeid + "\n")


def pytest_runtest_logstart(nodeid, location):
    _note("started", nodeid)


def pytest_runtest_logreport(report):
    if report.failed:
        _FAILURES.append(report.nodeid)
        _note("failed", report.nodeid)
    elif report.when == "teardown" and report.nodeid not in _FAILURES:
        _note("passed", report.nodeid)  # what tests/distributed_session.py need not rerun after a crash


def pytest_collection_modifyitems(config, items):
    """Marks every test `distributed` (docs/testing.md, "Lanes"). A rerun after a native crash
    (tests/distributed_session.py) skips what passed on every rank before it; every rank reads
    the same file, so the ranks stay in step."""
    for item in items:
        item.add_marker(pytest.mark.distributed)
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
        print(f"\nthreads in rank 0 at the end (gloo keeps three per process group): {threads}; "
              f"process groups: {_live_groups()}")
        most = sorted(_GROUPS_MADE.items(), key=lambda item: -item[1])[:8]
        print("process groups made by test (the most): " + ", ".join(f"{nodeid} {n}" for nodeid, n in most))
        for rank, failures in enumerate(everyone):
            for nodeid in failures:
                print(f"\nrank {rank} failed: {nodeid}")
    if any(everyone):
        session.exitstatus = 1


# Every gloo process group keeps a thread that wakes ~100 times a second even when idle
# (measured: 150 idle groups cost each of 4 ranks 23 % of a core, half of this 2-core machine),
# and groups cannot be destroyed once a test is done with them: DTensor's caches key on a mesh's
# shape and names, not its groups, so a later mesh of the same shape would find the destroyed
# groups there. So meshes of one shape share their groups: `dtmega.make_mesh` and
# `split_world` (the trainer's, the examples', `dtmega evaluate`'s) return the suite's cached
# mesh of those sizes (tests.helpers.mesh, the same mesh by test_meshes.py). The session prints
# how many groups the tests made and which made the most.
_GROUPS_MADE: dict[str, int] = {}


def _live_groups() -> int:
    from torch.distributed.distributed_c10d import _world

    return len(_world.pg_map)


@pytest.fixture(scope="session", autouse=True)
def _one_mesh_per_shape():
    """The library's meshes, for the whole session, are the suite's cached mesh of their sizes
    (dtmega's named axes, or those under a `replica` axis: split_world's), or one mesh per other
    shape: the library builds its meshes through `dtmega.mesh.init_device_mesh`."""
    import dtmega.mesh
    from dtmega.mesh import AXES
    from tests.helpers import mesh

    others: dict = {}

    def shared(device_type, mesh_shape, *, mesh_dim_names=None, **options):
        names, shape = tuple(mesh_dim_names or ()), tuple(mesh_shape)
        if device_type == "cpu" and not options and names in (AXES, ("replica", *AXES)):
            cached = mesh(**dict(zip(AXES, shape[-len(AXES):])))  # the replica axis is what is left of the world
            return cached if names == AXES else cached._get_root_mesh()
        key = (device_type, shape, names, tuple(sorted(options.items())))
        if key not in others:
            others[key] = init_device_mesh(device_type, mesh_shape, mesh_dim_names=mesh_dim_names, **options)
        return others[key]

    dtmega.mesh.init_device_mesh = shared
    yield
    dtmega.mesh.init_device_mesh = init_device_mesh


@pytest.fixture
def fresh_library_meshes(monkeypatch):
    """For the tests of the cache itself: dtmega's meshes built by torch, with fresh groups."""
    import dtmega.mesh

    monkeypatch.setattr(dtmega.mesh, "init_device_mesh", init_device_mesh)


@pytest.fixture(autouse=True)
def _lockstep(request):
    """Seeds every test alike on every rank and keeps ranks in step between tests."""
    torch.manual_seed(0)
    before = _live_groups()
    yield
    dist.barrier(group=_BETWEEN_TESTS)
    made = _live_groups() - before
    if made > 0:
        _GROUPS_MADE[request.node.nodeid] = made


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

