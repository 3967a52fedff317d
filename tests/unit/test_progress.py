"""Progress of long commands: a bar with ETA on a terminal, periodic lines otherwise, shown from
the start of the work; `dtmega evaluate` shows it with and without a terminal."""

from __future__ import annotations

import io
import itertools
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from dtmega.progress import progress_bar

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_terminal_lines_come_at_the_start_periodically_and_at_the_end(monkeypatch):
    monkeypatch.setenv("DTMEGA_PROGRESS_SECONDS", "0")
    out = io.StringIO()
    with progress_bar("evaluate", total=4, unit="batches", console=Console(file=out, width=200)) as bar:
        assert out.getvalue() == "evaluate: 0/4 batches (0 %)\n"  # before the first unit of work
        for _ in range(4):
            time.sleep(0.01)
            bar.advance()
    lines = out.getvalue().splitlines()
    assert len(lines) == 6 and lines[2].startswith("evaluate: 2/4 batches (50 %), ") and lines[2].endswith(" s left")
    assert "batches/s" in lines[2] and lines[-1].startswith("evaluate: 4/4 batches (100 %), done in")


def test_lines_wait_for_the_interval(monkeypatch):
    monkeypatch.setenv("DTMEGA_PROGRESS_SECONDS", "60")
    out = io.StringIO()
    with progress_bar("tokenizing", total=3 << 20, console=Console(file=out, width=200), in_bytes=True) as bar:
        for _ in range(3):
            bar.advance(1 << 20)
    assert out.getvalue().splitlines() == ["tokenizing: 0.0 MiB/3.0 MiB (0 %)",
                                           out.getvalue().splitlines()[-1]]
    assert "3.0 MiB/3.0 MiB (100 %), done in" in out.getvalue()


def test_phases_name_what_is_being_done(monkeypatch):
    out = io.StringIO()
    with progress_bar("loading ckpt", total=2, unit="phases", console=Console(file=out, width=200), phased=True) as bar:
        bar.phase("checking files")
        bar.phase("reading weights")
    assert out.getvalue().splitlines() == [
        "loading ckpt: checking files: 0/2 phases (0 %)", "loading ckpt: reading weights: 1/2 phases (50 %)",
        out.getvalue().splitlines()[-1]]
    assert out.getvalue().splitlines()[-1].startswith("loading ckpt: 2/2 phases (100 %), done in")


def test_on_a_terminal_a_bar_with_eta():
    out = io.StringIO()
    with progress_bar("evaluate", total=3, unit="batches", console=Console(file=out, force_terminal=True, width=120)) as bar:
        for _ in range(3):
            bar.advance()
    assert "━" in out.getvalue() and "ETA" in out.getvalue() and "3/3" in out.getvalue()


def _evaluate_command(checkpoint: Path, batches: int) -> list[str]:
    data = checkpoint.parent / "data" / "corpus_text_document"
    return [sys.executable, "-m", "dtmega", "evaluate", "--load", str(checkpoint), "--data-path", str(data),
            "--split", "0,1,0", "--seq-length", "32", "--micro-batch-size", "1", "--eval-iters", str(batches)]


def test_evaluate_shows_progress_from_the_start_without_a_terminal(tiny_checkpoint):
    env = dict(os.environ, DTMEGA_PROGRESS_SECONDS="0.05", PYTHONUNBUFFERED="1")
    started = time.monotonic()
    process = subprocess.Popen(_evaluate_command(tiny_checkpoint, 300), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    seen = [(time.monotonic() - started, line) for line in process.stderr]
    out = process.stdout.read()
    assert process.wait() == 0 and "loss" in out
    texts = [line for _, line in seen]
    # The first line comes before torch is imported (it says so, and nothing precedes it): the
    # import itself can take seconds on a busy machine, and that line covers it.
    assert texts[0].startswith("dtmega evaluate: starting (importing torch)"), seen
    assert texts[1].startswith("loading ") and any(t.startswith("evaluate: 0/") for t in texts), texts
    evaluating = [(t, line) for t, line in seen if line.startswith("evaluate: ")]
    assert len(evaluating) >= 3 and "done in" in evaluating[-1][1]  # the start, updates, the end
    # While it evaluates, a line at least every DTMEGA_PROGRESS_SECONDS (0.05 s): 5 s of silence
    # there would mean no periodic line at all (not a wall-clock race: 100 x the interval).
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(evaluating)]
    assert max(gaps) < 5.0, evaluating  # never silent for long


def test_evaluate_shows_a_bar_on_a_terminal(tiny_checkpoint):
    leader, follower = pty.openpty()
    process = subprocess.Popen(_evaluate_command(tiny_checkpoint, 20), cwd=ROOT, stdout=follower, stderr=follower,
                               env=dict(os.environ, COLUMNS="120"))
    os.close(follower)
    output = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    assert process.wait(60) == 0
    text = output.decode(errors="replace")
    assert "━" in text and "ETA" in text and "loss" in text
