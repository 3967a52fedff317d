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
# Lanes (docs/testing.md, "Lanes"). Every test of tests/unit is marked by what it needs:
# `unit` (pure: it runs in this process; `make test-fast`, what a developer runs between edits)
# or `system` (it launches a process: a dtmega command in a subprocess, torchrun, a server, a
# venv install; `make test` runs both, and tests/distributed is the third lane). A `unit` test
# that starts a process fails, naming this table: the fast lane stays pure by construction.

SYSTEM: dict[str, str] = {  # test file (or file::test) -> what it launches
    "test_benchmark_peers.py": "the benchmark scripts in a child interpreter",
    "test_cli_errors.py": "the dtmega command as a user runs it",
    "test_cost_model.py": "dtmega plan and a measured run in a child interpreter",
    "test_custom_plan.py": "torchrun training with a --plan file",
    "test_docs.py": "every doc block's commands (torchrun, train, serve, benchmarks)",
    "test_dry_run_equals_launch.py": "torchrun launches beside their dry runs",
    "test_eight_ranks.py": "an 8-rank torchrun job",
    "test_float8_plan.py": "a training command with FP8",
    "test_hang_free.py": "torchrun jobs with missing or stuck ranks",
    "test_load_flags.py": "training commands that save and resume",
    "test_megatron_checkpoints.py": "megatron-core under torchrun to write its checkpoints",
    "test_megatron_examples.py": "Megatron's example lines under torchrun",
    "test_megatron_training.py": "megatron-core and dtmega train side by side under torchrun",
    "test_packaging.py": "a wheel build and a clean venv install",
    "test_preprocess.py": "dtmega preprocess with worker processes",
    "test_progress.py": "a training command whose console is read live",
    "test_rank_errors.py": "torchrun jobs where one rank fails",
    "test_restart.py": "torchrun --max-restarts jobs",
    "test_resume_and_signals.py": "training commands stopped by signals",
    "test_save_ownership.py": "two training commands on one --save",
    "test_serve_http.py": "dtmega serve over HTTP (torchrun for TP)",
    "test_sft.py": "SFT training commands",
    "test_simulation.py": "the 405B simulation (a fake process group needs a fresh process)",
    "test_train_single_rank.py": "dtmega train in a child interpreter",
    "test_two_nodes.py": "two torchrun 'nodes' on one machine",
    "test_preprocess_memory.py": "dtmega preprocess's worker processes on a 200 MB input",
    "test_serve_chat.py": "the chat server (HTTP, the OpenAI client)",
    "test_serve_load.py": "dtmega serve under 200 concurrent mixed and hostile requests",
    "test_sft_checkpoint_chat.py::test_serve_answers_chat_with_the_checkpoints_own_template": "the chat server",
    "test_sft_checkpoint_chat.py::test_serve_chat_template_overrides_the_checkpoints_own": "the chat server",
    "test_logging_flags.py::test_an_offline_wandb_run_holds_the_config_and_every_record": "wandb's service process",
    # inductor compiles C++ in a compiler process (g++), when its cache is cold
    "test_step_capture.py": "compiled and captured training steps (inductor), and the capture benchmark",
    "test_torch_messages.py::test_the_captured_step_keeps_torchs_messages_out_of_the_console": "a compiled step",
    "test_document_masking.py::test_flexattention_forward_on_cpu_equals_each_document_alone_and_has_no_backward_there":
        "flex attention compiled by inductor",
}

_POPEN = subprocess.Popen


def _launch(*args, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run with the real Popen: the conftest's own child pytest (the interpreter
    fixture's) is infrastructure, not the test's launch."""
    refused, subprocess.Popen = subprocess.Popen, _POPEN
    try:
        return subprocess.run(*args, **kwargs)
    finally:
        subprocess.Popen = refused


def _lane(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    path = path.removeprefix("tests/unit/")
    return "system" if path in SYSTEM or f"{path}::{name.partition('[')[0]}" in SYSTEM else "unit"


def pytest_collection_modifyitems(config, items):
    """Marks each test `unit` or `system` (SYSTEM); `-m unit` is the fast lane."""
    for item in items:
        item.add_marker(getattr(pytest.mark, _lane(item.nodeid)))


class _PureTestLaunched(AssertionError):
    pass


@pytest.fixture(autouse=True)
def _unit_tests_launch_nothing(request, monkeypatch):
    """A `unit` test may not start a process (subprocess, torchrun, a dtmega command in a child):
    it fails naming the fix, so `make test-fast` keeps to what runs in this process."""
    if request.node.get_closest_marker("unit") is None:
        return

    class Refused(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            raise _PureTestLaunched(f"{request.node.nodeid} is in the fast lane (marked unit) but launches "
                                    f"{str(args)[:200]}. Fix: add its file to SYSTEM in tests/unit/conftest.py "
                                    "with what it launches")

    monkeypatch.setattr(subprocess, "Popen", Refused)


# ---------------------------------------------------------------------------------------------
# The Triton interpreter, and a 1-rank DTensor mesh.

_CHILD_OUTCOMES: dict[str, str] = {}  # node id -> 'passed' or what went wrong


def _outcomes_in_fresh_process(node_ids: list[str], rootdir: str) -> dict[str, str]:
    """Runs the given tests in one child pytest with TRITON_INTERPRET=1 set from the start:
    {node id: 'passed' | what failed}."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        env = dict(os.environ, TRITON_INTERPRET="1", DTMEGA_INTERPRETER_CHILD="1")
        proc = _launch(
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
