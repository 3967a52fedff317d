"""No run clobbers another's checkpoints, and `latest` never moves back by accident (issue 31,
"Data safety"). Each refusal comes before any training, leaves every file of the directory as it
was, and names `--overwrite-checkpoints`, which does it on purpose."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dtmega.cli import main as dtmega_main
from dtmega.train.checkpoint import CheckpointError, resolve_checkpoint, save_checkpoint
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("corpus"), documents=120)


def _run(corpus, save, iters=4, **flags):
    flags.setdefault("save_interval", 2)
    return train(tiny_args(corpus, train_iters=iters, save=str(save), eval_iters=1, **flags))


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under `directory` with its size and modification time in ns."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def other_run(corpus, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("other") / "ckpt"
    _run(corpus, save)
    return save


def test_a_fresh_run_refuses_a_save_holding_another_runs_checkpoints(corpus, other_run, capsys):
    before = snapshot(other_run)
    with pytest.raises(CheckpointError, match=r"--save .* holds checkpoints of run \w+ \(latest iter_0000004, step 4\)"
                                              r", and this run does not resume it .*--overwrite-checkpoints"):
        _run(corpus, other_run, iters=2)
    assert snapshot(other_run) == before
    assert dtmega_main(["train", *tiny_args(corpus, train_iters=2, save=str(other_run))]) == 2
    assert "Fix: pass --load" in capsys.readouterr().err
    assert snapshot(other_run) == before


def test_a_fresh_run_from_a_hugging_face_model_refuses_a_save_holding_another_runs_checkpoints(
        corpus, other_run, tmp_path, monkeypatch):
    """docs/reliability.md, Runs: "a fresh run (no `--load`, or `--load-hf`) whose `--save` holds
    another run's checkpoints" is refused ("holds checkpoints of run ..."), before any work
    (no process group is made: the patch fails the test if one is) and every file untouched."""
    from tests.hf_models import save_tiny_llama31

    hf = save_tiny_llama31(tmp_path / "hf")
    before = snapshot(other_run)
    monkeypatch.setattr("dtmega.train.trainer.init_distributed",
                        lambda *a, **k: pytest.fail("the run started before --save was checked"))
    argv = tiny_args(corpus, load_hf=str(hf), train_iters=2, save=str(other_run), num_layers=None, hidden_size=None,
                     ffn_hidden_size=None, num_attention_heads=None, num_query_groups=None)
    argv = [flag for flag in argv if flag not in ("--group-query-attention", "--swiglu")]  # the config says
    with pytest.raises(CheckpointError, match=r"--save .* holds checkpoints of run \w+ \(latest iter_0000004, step 4\)"
                                              r", and this run does not resume it \(no --load\).*Fix: pass --load"):
        train(argv)
    assert snapshot(other_run) == before


def test_overwrite_checkpoints_starts_over_and_says_so(corpus, other_run, tmp_path, capsys):
    import shutil

    save = tmp_path / "ckpt"
    shutil.copytree(other_run, save)
    first_id = json.loads((save / "iter_0000004" / "state.json").read_text())["run_id"]
    _run(corpus, save, iters=2, overwrite_checkpoints=True)
    assert "--overwrite-checkpoints: " in capsys.readouterr().out
    assert resolve_checkpoint(save).name == "iter_0000002"
    assert json.loads((save / "iter_0000002" / "state.json").read_text())["run_id"] != first_id


def test_a_resume_keeps_its_run_and_may_not_move_latest_back(corpus, other_run, tmp_path):
    import shutil

    save = tmp_path / "ckpt"
    shutil.copytree(other_run, save)
    run_id = json.loads((save / "iter_0000004" / "state.json").read_text())["run_id"]
    before = snapshot(save)
    with pytest.raises(CheckpointError, match=r"its latest is iter_0000004 \(step 4\), but this run starts at step 2 .*"
                                              r"move latest back"):
        _run(corpus, save, iters=6, load=str(save / "iter_0000002"))
    assert snapshot(save) == before
    _run(corpus, save, iters=6, load=str(save))  # the restartable launch: --load = --save
    assert resolve_checkpoint(save).name == "iter_0000006"
    assert json.loads((save / "iter_0000006" / "state.json").read_text())["run_id"] == run_id


def test_a_resume_refuses_a_save_of_another_run(corpus, other_run, tmp_path):
    mine = tmp_path / "mine"
    _run(corpus, mine, iters=2)
    before = snapshot(other_run)
    with pytest.raises(CheckpointError, match=r"holds checkpoints of run .* but this run resumes .*mix two runs"):
        _run(corpus, other_run, iters=6, load=str(mine))
    assert snapshot(other_run) == before


def test_save_checkpoint_itself_never_moves_latest_back(other_run, tmp_path):
    import torch

    with pytest.raises(CheckpointError, match="would move its latest back from iter_0000004"):
        save_checkpoint(other_run, 1, torch.nn.Linear(2, 2), None, {})


def test_convert_obeys_the_same_rules(other_run, tmp_path, capsys):
    from tests.hf_models import save_tiny_llama31

    hf = save_tiny_llama31(tmp_path / "hf")
    before = snapshot(other_run)
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(hf), "--save", str(other_run)]) == 2
    assert "dtmega convert hf-to-dtmega does not resume it" in capsys.readouterr().err
    assert snapshot(other_run) == before
    import shutil

    save = tmp_path / "ckpt"
    shutil.copytree(other_run, save)
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(hf), "--save", str(save),
                        "--overwrite-checkpoints"]) == 0
    assert resolve_checkpoint(save).name == "iter_0000000"


def test_resaving_an_iteration_that_is_a_symlink_replaces_the_link_only(corpus, other_run, tmp_path):
    import shutil

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(other_run / "iter_0000002", elsewhere)
    kept = snapshot(elsewhere)
    save = tmp_path / "ckpt"
    _run(corpus, save, iters=2, save_interval=1)
    shutil.rmtree(save / "iter_0000002")
    os.symlink(elsewhere, save / "iter_0000002")
    (save / "latest").write_text("iter_0000001")
    _run(corpus, save, iters=2, load=str(save), save_interval=1)
    assert not (save / "iter_0000002").is_symlink() and resolve_checkpoint(save).name == "iter_0000002"
    assert snapshot(elsewhere) == kept


def test_a_second_job_on_the_same_save_is_refused_while_the_first_holds_it(corpus, tmp_path):
    """The lock is an flock held by rank 0 of the running job (here: another process holding
    it, as a running job does); it goes with its process, so a crashed job leaves none behind."""
    import subprocess
    import sys

    from dtmega.train.save_lock import LOCK

    save = tmp_path / "ckpt"
    save.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, json, os, sys, time; h = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(h, fcntl.LOCK_EX); os.write(h, json.dumps({'pid': os.getpid(), 'host': 'node7', "
        "'since': 'now'}).encode()); print('locked', flush=True); time.sleep(600)"), str(save / LOCK)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError, match=rf"--save {save} is in use by another job \(pid {holder.pid} on "
                                                  r"node7, since now\).*Fix: wait"):
            _run(corpus, save, iters=2)
        assert not any(save.glob("iter_*")) and not any(save.glob(".iter_*"))
    finally:
        holder.kill()
        holder.wait()
    _run(corpus, save, iters=2)  # the holder died (as a crashed job does): its lock went with it
    _run(corpus, save, iters=4, load=str(save))  # and each run freed its own on the way out
    assert resolve_checkpoint(save).name == "iter_0000004"


def test_a_full_disk_during_a_save_is_one_line_and_loses_nothing(corpus, tmp_path, monkeypatch):
    """N14: ENOSPC inside the second save was 191 lines of tracebacks from every rank. Now every
    rank raises the same one-line error, the partial save is gone and latest is intact."""
    import errno

    import torch

    from dtmega.train import checkpoint

    real_save, saves = torch.save, []

    def full_disk(obj, path, *args, **kwargs):
        if isinstance(path, (str, Path)):  # the RNG file (DCP also saves bytes entries into buffers)
            saves.append(path)
        if len(saves) == 2 and saves[-1] is path:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    save = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match=r"saving iter_0000004 into .* failed: rank 0: No space left on device "
                                              r"\(.*rng_rank00000.pt\); the partial save was removed and latest still "
                                              r"names iter_0000002. Fix: free space"):
        _run(corpus, save, iters=4)
    assert resolve_checkpoint(save).name == "iter_0000002"
    assert not list(save.glob(".iter_*")) and not (save / "iter_0000004").exists()


def test_a_full_disk_during_the_shard_write_is_the_same_one_line(corpus, tmp_path, monkeypatch):
    """docs/reliability.md, Runs: "the disk fills during a save" gives one line, the partial
    save removed and latest still naming the previous checkpoint, also when ENOSPC hits DCP's
    write of the shards (the bulk of a save; the test above fills the disk at the RNG file). The
    fault is injected into torch's per-item write after a few bytes of the step-4 shard reached
    the file, as a full disk does (the error carries no file name, as a failed write's does)."""
    import errno

    from torch.distributed.checkpoint import filesystem

    real_write_item, failed = filesystem._write_item, []

    def full_disk(transforms, stream, *args, **kwargs):
        if ".iter_0000004.partial" in str(getattr(stream, "name", "")):
            stream.write(b"\0" * 100)
            failed.append(stream.name)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_item(transforms, stream, *args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", full_disk)
    save = tmp_path / "ckpt"
    with pytest.raises(CheckpointError) as caught:
        _run(corpus, save, iters=4)
    assert failed, "the step-4 shard write was never reached"
    message = str(caught.value)
    assert message == (f"saving iter_0000004 into {save} failed: rank 0: No space left on device (writing its shard); "
                       f"the partial save was removed and latest still names iter_0000002. Fix: free space on that "
                       f"filesystem (or pass another --save), then resume with --load {save}")
    assert resolve_checkpoint(save).name == "iter_0000002" and (save / "latest").read_text().strip() == "iter_0000002"
    assert not list(save.glob(".iter_*")) and not (save / "iter_0000004").exists()


@pytest.mark.parametrize("signal_name, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_stop_inside_a_save_discards_it_and_a_resume_never_reads_it(corpus, tmp_path, monkeypatch, capsys,
                                                                       signal_name, status):
    """docs/reliability.md, Runs: Ctrl-C (SIGINT) or SIGTERM "during a step or a save": one line,
    exit 130 / 143, and "a save in progress is discarded (its `.partial` directory is never
    read)". The signal is sent to this process from inside DCP's write of the step-4 shard (the
    save blocked there, as a slow disk holds it), through `dtmega train` in this process with the
    command's own handlers. latest still names iter_0000002; a resume loads iter_0000002, not the
    partial step 4, and its own save of step 4 clears the partial directory."""
    import signal
    import time

    from torch.distributed.checkpoint import filesystem

    real_write_item, sent = filesystem._write_item, []

    def blocked_save(transforms, stream, *args, **kwargs):
        if ".iter_0000004.partial" in str(getattr(stream, "name", "")) and not sent:
            stream.write(b"\0" * 100)  # part of the shard is on disk
            sent.append(signal_name)
            os.kill(os.getpid(), getattr(signal, signal_name))
            time.sleep(60)  # the handler's exception interrupts the sleep at once (a signal sent to oneself
            pytest.fail("the signal did not stop the save")  # is delivered before kill returns)
        return real_write_item(transforms, stream, *args, **kwargs)

    def not_dtmegas(signum, frame):
        raise AssertionError(f"{signal_name} reached the test's own handler: dtmega's was not installed")

    monkeypatch.setattr(filesystem, "_write_item", blocked_save)
    previous = signal.signal(getattr(signal, signal_name), not_dtmegas)  # never pytest's death by SIGTERM
    save = tmp_path / "ckpt"
    try:
        code = dtmega_main(["train", *tiny_args(corpus, train_iters=6, save=str(save), save_interval=2, eval_iters=1)])
    finally:
        signal.signal(getattr(signal, signal_name), previous)
    err = capsys.readouterr().err
    assert sent and code == status, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("dtmega train: ")]
    assert len(lines) == 1 and lines[0].startswith(f"dtmega train: stopped by {signal_name}"), err[-3000:]
    assert "Traceback" not in err
    assert (save / "latest").read_text().strip() == "iter_0000002" and not (save / "iter_0000004").exists()
    assert (save / ".iter_0000004.partial").is_dir()  # discarded, left behind
    monkeypatch.setattr(filesystem, "_write_item", real_write_item)
    read = []
    real_load = __import__("dtmega.checkpoint_reader", fromlist=["load_dcp"]).load_dcp

    def spy_load(state, checkpoint, *args, **kwargs):
        read.append(Path(checkpoint).name)
        return real_load(state, checkpoint, *args, **kwargs)

    monkeypatch.setattr("dtmega.train.checkpoint.load_dcp", spy_load)
    resumed = _run(corpus, save, iters=4, load=str(save))
    assert read and set(read) == {"iter_0000002"}, read  # the partial step 4 is never read
    assert resumed.iteration == 4 and len(resumed.losses) == 2
    assert resolve_checkpoint(save).name == "iter_0000004" and not list(save.glob(".iter_*"))


@pytest.mark.parametrize("signal_name, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupt_ends_in_one_line_with_its_exit_status(corpus, tmp_path, signal_name, status):
    """N18/N19: Ctrl-C printed a traceback per rank (38-181 lines). Now one line, 130 for SIGINT
    and 143 for SIGTERM (128 + the signal, as shells report them), checkpoints intact."""
    import signal
    import subprocess
    import sys

    save = tmp_path / "ckpt"
    command = [sys.executable, "-m", "dtmega", "train", *tiny_args(corpus, train_iters=100000, save=str(save),
                                                                      save_interval=2, log_interval=1, eval_iters=1)]
    # started as a terminal's foreground job: SIGINT not ignored even when this suite runs as a
    # background job of a non-interactive shell (which ignores SIGINT, inherited by every child;
    # a Python handler is not inherited: the child starts with the default)
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    finally:
        signal.signal(signal.SIGINT, ignored)
    for line in process.stdout:
        if "saved checkpoint" in line:
            break
    process.send_signal(getattr(signal, signal_name))
    _, err = process.communicate(timeout=120)
    assert process.returncode == status, err[-2000:]
    assert f"stopped by {signal_name}" in err and "Traceback" not in err, err[-2000:]
    assert resolve_checkpoint(save).name.startswith("iter_")


def test_a_dry_run_says_the_launch_would_be_refused_today(corpus, other_run, capsys):
    """A dry run checks a launch days before it runs (as for --save's room): said, not refused."""
    before = snapshot(other_run)
    train(tiny_args(corpus, train_iters=2, save=str(other_run), dry_run=1))
    assert "today this launch would be refused: --save" in capsys.readouterr().out
    assert snapshot(other_run) == before
