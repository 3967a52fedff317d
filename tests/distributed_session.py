"""Runs the distributed suite: one 4-rank torchrun pytest session on CPU/gloo.

    .venv/bin/python tests/distributed_session.py      (what `make test` runs after the unit tests)

torchrun runs `--standalone` (its rendezvous on a free port): two sessions on one machine, or a
session beside a training job, never meet on the default port 29500. A test that fails fails
the session. A rank that dies of a signal is another matter: the suite
has seen a rare native crash (SIGSEGV, about one session in eight, at a different test each
time, never reproduced by rerunning that test; docs/testing.md "Native crashes"). When that
happens this runner prints the dead rank's Python stacks (faulthandler, written by
tests/distributed/conftest.py to DTMEGA_TEST_CRASH_DIR) and runs the tests the crashed session
had not finished once more, in a fresh session. A second crash, or any failure in the rerun,
fails the run; a rerun that passes says so loudly, with the stacks above it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANKS = 4


def _session(crash_dir: Path, env: dict[str, str], skip_finished: Path | None) -> int:
    """One torchrun session over tests/distributed; rank 0's console streams through."""
    env = {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"), "DTMEGA_TEST_CRASH_DIR": str(crash_dir)}
    env.pop("DTMEGA_TEST_SKIP_FINISHED", None)
    if skip_finished is not None:
        env["DTMEGA_TEST_SKIP_FINISHED"] = str(skip_finished)
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", str(RANKS),
               "--local-ranks-filter", "0", "-m", "pytest", "tests/distributed", "-q", "-p", "no:cacheprovider",
               "--durations=30"]
    return subprocess.run(command, cwd=ROOT, env=env).returncode


def crash_stacks(crash_dir: Path) -> dict[str, str]:
    """The faulthandler output of every rank that died of a signal (empty files are live ranks)."""
    stacks = {}
    for path in sorted(crash_dir.glob("rank*.txt")):
        text = path.read_text(errors="replace").strip()
        if text:
            stacks[path.stem] = text
    return stacks


def passed_everywhere(crash_dir: Path) -> list[str]:
    """The tests that passed on every rank before the crash (the conftest appends each rank's)."""
    lists = [path.read_text().splitlines() for path in sorted(crash_dir.glob("passed-rank*.txt"))]
    if len(lists) < RANKS:
        return []
    common = set.intersection(*(set(passed) for passed in lists))
    return [nodeid for nodeid in lists[0] if nodeid in common]


def main(env: dict[str, str] | None = None) -> int:
    """Runs the session; on a native crash, prints the stacks and reruns what had not finished."""
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="dtmega-dist-") as scratch:
        first = Path(scratch, "first")
        code = _session(first, env, None)
        stacks = crash_stacks(first)
        if code == 0 or not stacks:
            return code
        for rank, text in stacks.items():
            print(f"\n===== {rank} died of a signal; its stacks (faulthandler) =====\n{text}", flush=True)
        finished = first / "finished.txt"
        done = passed_everywhere(first)
        finished.write_text("".join(f"{nodeid}\n" for nodeid in done))
        print(f"\n===== native crash after {len(done)} finished tests: rerunning the rest once in a fresh "
              f"session (docs/testing.md, 'Native crashes') =====", flush=True)
        second = Path(scratch, "second")
        code = _session(second, env, finished)
        for rank, text in crash_stacks(second).items():
            print(f"\n===== rerun: {rank} died of a signal; its stacks =====\n{text}", flush=True)
        print(f"\n===== the rerun {'passed' if code == 0 else 'FAILED'}; the first session crashed "
              f"({', '.join(stacks)}): see the stacks above =====", flush=True)
        return code


if __name__ == "__main__":
    sys.exit(main())
