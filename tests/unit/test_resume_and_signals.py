"""Matrix-2's last cases (../shared/reliability/matrix-2.md), as real launches:

- N60/N62: a checkpoint of a 2-rank data-parallel run resumes on 1 rank, and on 4 ranks as
  TP2 x DP2 with the distributed optimizer, logging the uninterrupted run's losses (1e-5
  relative: other rank counts reduce in another order; the matrix measured 0 and 4.8e-7).
- N16/N17: SIGTERM to torchrun after a save, or during step 1, ends the job with dtmega's one
  line (exit non-zero), leaves every complete checkpoint intact (nothing written before the first
  save), and a restart resumes with the uninterrupted losses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("corpus"), documents=120)


def _argv(corpus: str, **flags) -> list[str]:
    flags = {"train_iters": 8, "save_interval": 2, "log_interval": 1, "eval_iters": 0, **flags}
    return tiny_args(corpus, **flags)


def _torchrun(ranks: int, argv: list[str], **popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "--local-ranks-filter", "0", "-m", "dtmega", "train", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "250"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **popen)


def _losses(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """An uninterrupted 2-rank DP2 run of 8 steps, checkpoints every 2."""
    root = tmp_path_factory.mktemp("reference")
    done = _torchrun(2, _argv(corpus, save=str(root / "ckpt"), log_file=str(root / "m.jsonl")))
    output, _ = done.communicate(timeout=300)
    assert done.returncode == 0, output[-3000:]
    return root / "ckpt", _losses(root / "m.jsonl")


def _close(resumed: dict[int, float], expected: dict[int, float]) -> None:
    assert sorted(resumed) == [5, 6, 7, 8], resumed
    for step, loss in resumed.items():
        assert abs(loss - expected[step]) <= 1e-5 * abs(expected[step]), (step, loss, expected[step])


def test_a_two_rank_checkpoint_resumes_on_one_rank(corpus, reference, tmp_path):
    """N60."""
    save, expected = reference
    train(tiny_args(corpus, **{**dict(train_iters=8, log_interval=1, eval_iters=0), "load": str(save / "iter_0000004"),
                               "log_file": str(tmp_path / "m.jsonl")}))
    _close(_losses(tmp_path / "m.jsonl"), expected)


def test_a_two_rank_checkpoint_resumes_on_four_ranks_as_tp2_dp2(corpus, reference, tmp_path):
    """N62."""
    save, expected = reference
    done = _torchrun(4, _argv(corpus, load=str(save / "iter_0000004"), log_file=str(tmp_path / "m.jsonl"),
                              tensor_model_parallel_size=2, use_distributed_optimizer=True, save_interval=None))
    output, _ = done.communicate(timeout=300)
    assert done.returncode == 0, output[-3000:]
    _close(_losses(tmp_path / "m.jsonl"), expected)


@pytest.mark.parametrize("when", ["after_the_step_4_save", "during_step_1"], ids=["N16", "N17"])
def test_sigterm_to_torchrun_ends_in_one_line_and_a_restart_resumes(corpus, reference, tmp_path, when):
    _, expected = reference
    save = tmp_path / "ckpt"
    argv = _argv(corpus, save=str(save), load=str(save), log_file=str(tmp_path / "m.jsonl"))
    job = _torchrun(2, argv)
    # the path of the step-4 checkpoint, printed once it is saved (it may wrap onto a line of its own)
    trigger = "iter_0000004" if when == "after_the_step_4_save" else "unigram entropy"
    for line in job.stdout:
        if trigger in line:
            break
    job.send_signal(signal.SIGTERM)
    output = job.stdout.read()
    status = job.wait(timeout=120)
    assert status != 0 and "stopped by SIGTERM" in output and "[rank0]: Traceback" not in output, output[-3000:]
    if when == "during_step_1":
        assert not list(save.glob("iter_*")), "nothing is written before the first save"
    else:
        assert (save / "latest").read_text().strip() in ("iter_0000004", "iter_0000006")
    again = _torchrun(2, [*argv[:argv.index("--log-file")], "--log-file", str(tmp_path / "again.jsonl"),
                          *argv[argv.index("--log-file") + 2:]])
    output, _ = again.communicate(timeout=300)
    assert again.returncode == 0, output[-3000:]
    resumed = _losses(tmp_path / "again.jsonl")
    assert max(resumed) == 8
    for step, loss in resumed.items():  # the same ranks and plan: the same sums (1e-6: printing, nothing else)
        assert abs(loss - expected[step]) <= 1e-6 * abs(expected[step]), (step, loss, expected[step])
