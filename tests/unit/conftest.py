"""Fixtures of the unit suite: Triton's interpreter for the kernel tests, a one-rank mesh."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from xml.etree import ElementTree

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dtmega.kernels.triton_support import interpreter_ready, triton_available

# ---------------------------------------------------------------------------------------------
# The Triton interpreter, and a 1-rank DTensor mesh.

_CHILD_OUTCOMES: dict[str, str] = {}  # node id -> 'passed' or what went wrong


def _outcomes_in_fresh_process(node_ids: list[str], rootdir: str) -> dict[str, str]:
    """Runs the given tests in one child pytest with TRITON_INTERPRET=1 set from the start:
    {node id: 'passed' | what failed}."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        env = dict(os.environ, TRITON_INTERPRET="1", DTMEGA_INTERPRETER_CHILD="1")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *node_ids],
            cwd=rootdir, env=env, capture_output=True, text=True, timeout=900)
        if not os.path.exists(report):
            return {node: f"the child pytest did not run:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
                    for node in node_ids}
        outcomes = {}
        for case in ElementTree.parse(report).iter("testcase"):
            node = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
            problems = [c for c in case if c.tag in ("failure", "error", "skipped")]
            outcomes[node] = "passed" if not problems else f"{problems[0].tag}: {problems[0].text}"
        return outcomes


@pytest.fixture
def interpret(monkeypatch, request) -> bool:
    """Runs Triton kernels on CPU tensors under TRITON_INTERPRET=1. True: run the test here.

    False: triton was imported before the variable was set (tests.helpers imports it, through
    torch.compile's machinery), so its own library (tl.sum, ...) was built for the compiler and
    the interpreter cannot call it. Then every test of this session that uses this fixture runs
    once, together, in a fresh pytest process with the variable set from the start; this test
    asserts its outcome there and the caller returns at once."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not triton_available():
        pytest.skip(reason="triton is not installed (CPU-only installs without the dev extra): the Triton kernels "
                           "cannot be interpreted")
    if interpreter_ready():
        return True
    assert not os.environ.get("DTMEGA_INTERPRETER_CHILD"), "triton was imported before TRITON_INTERPRET=1"
    node = request.node.nodeid
    if node not in _CHILD_OUTCOMES:
        nodes = [item.nodeid for item in request.session.items if "interpret" in getattr(item, "fixturenames", ())]
        nodes = [n for n in nodes if n not in _CHILD_OUTCOMES] or [node]
        _CHILD_OUTCOMES.update(_outcomes_in_fresh_process(nodes, str(request.config.rootpath)))
    outcome = _CHILD_OUTCOMES.get(node, "not reported by the child pytest")
    assert outcome == "passed", f"{node} in a fresh interpreter process: {outcome}"
    return False


@pytest.fixture
def one_rank_mesh():
    """A 1-rank gloo world (or the one a previous test left) and a 1-D mesh on it."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip(reason="a process group of several ranks is active: a 1-rank mesh cannot be built inside it")
    yield DeviceMesh("cpu", [0])
    if created:
        dist.destroy_process_group()




@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A trained tiny byte-level checkpoint (128-token context), made once per session."""
    from tests.train_helpers import train_tiny_checkpoint

    return train_tiny_checkpoint(tmp_path_factory.mktemp("tiny_checkpoint"))
