"""The whole suite, as `make test` (and so CI) runs it.

    .venv/bin/python tests/suite.py

1. The unit tests on two pytest-xdist workers (`-n 2 --dist loadgroup`; tests/unit/conftest.py
   groups them by file and hands out the longest file first). Most of them wait on one
   subprocess at a time (a documented command, a `dtmega` launch), so one session leaves a core
   of this 2-core machine idle; two workers keep both busy. Every process of the suite runs
   with one OpenMP thread: with torch's default two threads per process and more processes
   than cores, a 3-second in-process training test ran past the 300-second timeout.
2. The unit tests whose launches have deadlines of seconds (`SERIAL`: a 6-second collective
   timeout, a rank named "within seconds", restarts, 8 ranks on 2 cores), in one plain session,
   so that nothing else competes for the cores while they run.
3. The distributed session (tests/distributed_session.py: 4 ranks, one process group).

Every test runs; the run fails if any session fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SERIAL = (
    "tests/unit/test_hang_free.py",
    "tests/unit/test_rank_errors.py",
    "tests/unit/test_restart.py",
    "tests/unit/test_resume_and_signals.py",
    "tests/unit/test_two_nodes.py",
    "tests/unit/test_eight_ranks.py",
)
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=15"]


def sessions() -> list[tuple[str, list[str]]]:
    """(name, command) of each session, in the order they run."""
    parallel = [*PYTEST, "tests/unit", "-n", "2", "--dist", "loadgroup", "--max-worker-restart", "0",
                *(f"--ignore={path}" for path in SERIAL)]
    return [("unit tests on two workers", parallel),
            ("unit tests with deadlines, alone", [*PYTEST, *SERIAL]),
            ("distributed session", [sys.executable, str(ROOT / "tests" / "distributed_session.py")])]


def main() -> int:
    """Runs the sessions one after the other (all of them, even after a failure); 0 only if
    every one passed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started, failed = time.monotonic(), []
    for name, command in sessions():
        begun = time.monotonic()
        code = subprocess.run(command, cwd=ROOT, env=env).returncode
        print(f"\n===== {name}: {'passed' if code == 0 else 'FAILED'} in {(time.monotonic() - begun) / 60:.1f} min "
              "=====\n", flush=True)
        if code != 0:
            failed.append(name)
    total = (time.monotonic() - started) / 60
    print(f"===== {'FAILED: ' + ', '.join(failed) if failed else 'all sessions passed'}; {total:.1f} min in all =====",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
