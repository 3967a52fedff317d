"""Auto-resume (issue 18): Megatron's restartable launch, one directory as --save and --load,
under `torchrun --max-restarts 1`. A rank killed with SIGKILL mid-run makes torchrun restart
every worker; the restarted job resumes from the latest intact checkpoint by itself and logs the
same losses as an uninterrupted run, step for step.

Two real 2-rank torchrun jobs (subprocesses): the uninterrupted reference, and the one whose
rank 1 is killed once its first checkpoints exist.

A finished job must exit 0: a worker that printed its final loss once aborted in interpreter
finalization ("terminate called without an active exception", SIGABRT; under load, after a
restart), destroying a process group whose gloo threads were still running. Every worker here
carries an exit probe (a `sitecustomize` on PYTHONPATH): an `atexit` hook, run only if the
interpreter is finalized, that records any gloo thread still alive then. None may be."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.save_gate import gate_env, make_gate, release, wait_until_held
from tests.train_helpers import prepare_corpus, tiny_args

STEPS, SAVE_EVERY = 24, 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("corpus"), documents=200)


EXIT_PROBE = """
import atexit, glob, os

def _gloo_threads_at_finalization():
    names = [open(path).read().strip() for path in glob.glob("/proc/self/task/*/comm")]
    alive = [name for name in names if "gloo" in name]
    if alive and "RANK" in os.environ:
        path = os.path.join(os.environ["DTMEGA_EXIT_PROBE"], f"rank{os.environ['RANK']}-pid{os.getpid()}.txt")
        with open(path, "w") as out:
            out.write(" ".join(alive))

atexit.register(_gloo_threads_at_finalization)
"""


def _probe_dir(run: Path) -> Path:
    probe = run / "exit-probe"
    return make_gate(probe, extra_sitecustomize=EXIT_PROBE)  # the gate holds only where DTMEGA_TEST_GATE is set


def _finalized_with_gloo_threads(run: Path) -> list[str]:
    return [f"{path.stem}: {path.read_text()}" for path in sorted((run / "exit-probe").glob("rank*.txt"))]


def _launch(corpus: str, run: Path, restarts: int, hold_at: int | None = None) -> subprocess.Popen:
    argv = tiny_args(corpus, train_iters=STEPS, save=run / "ckpt", load=run / "ckpt", save_interval=SAVE_EVERY,
                     log_interval=1, eval_iters=0, log_file=run / "metrics.jsonl",
                     tensor_model_parallel_size=2)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", str(restarts), "-m", "dtmega", "train", *argv]
    probe = _probe_dir(run)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTMEGA_EXIT_PROBE": str(probe),
           **(gate_env(probe, hold_at) if hold_at else {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(command, stdout=open(run / "out.txt", "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _losses(run: Path) -> dict[int, float]:
    """step -> loss of every logged step (the restarted attempt's entries replace the first's)."""
    losses = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record and "step" in record:
            losses[record["step"]] = record["loss"]
    return losses


def _worker_of_rank(launcher: int, rank: int) -> int | None:
    """The pid of the worker with RANK=`rank` among the launcher's children (Linux /proc)."""
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(child)
    return None


def _wait(process: subprocess.Popen, run: Path, seconds: float = 300) -> str:
    try:
        process.wait(timeout=seconds)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return (run / "out.txt").read_text()


def test_a_killed_rank_is_restarted_by_torchrun_and_resumes_with_the_same_losses(corpus, tmp_path):
    reference_run, restarted_run = tmp_path / "reference", tmp_path / "restarted"
    reference_run.mkdir(), restarted_run.mkdir()
    out = _wait(_launch(corpus, reference_run, restarts=0), reference_run)
    reference = _losses(reference_run)
    assert sorted(reference) == list(range(1, STEPS + 1)), out
    assert not _finalized_with_gloo_threads(reference_run), _finalized_with_gloo_threads(reference_run)

    launcher = _launch(corpus, restarted_run, restarts=1, hold_at=2 * SAVE_EVERY)
    gate = restarted_run / "exit-probe"
    wait_until_held(gate, 2, [launcher], restarted_run / "out.txt")  # both ranks stand after their second save
    victim = _worker_of_rank(launcher.pid, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    release(gate)
    out = _wait(launcher, restarted_run)
    assert launcher.returncode == 0, out
    resumed_at = int(out.split("resumed from ")[1].split(" at step ")[1].split()[0])
    assert resumed_at >= 2 * SAVE_EVERY and resumed_at % SAVE_EVERY == 0, out
    restarted = _losses(restarted_run)
    assert sorted(restarted) == list(range(1, STEPS + 1)), out
    assert not _finalized_with_gloo_threads(restarted_run), _finalized_with_gloo_threads(restarted_run)
    # The same plan on the same ranks runs the same kernels in the same order, and a resume
    # restores every state (weights, optimizer, data position, RNG): the losses are bit-identical.
    assert restarted == reference, out
