"""The whole suite, as `make test` (and so CI) runs it: the unit tests and the distributed
session side by side.

    .venv/bin/python tests/suite.py

The machine this project is tested on has 2 cores. Run one after the other, the two sessions
leave a core idle for long stretches: most unit tests wait on one subprocess (a documented
command, a `dtmega` launch) and the distributed session's 4 ranks wait on each other's
collectives. So the distributed session (tests/distributed_session.py, its output kept in a
file and printed when it ends) runs in the background while the unit suite runs in front on two
pytest-xdist workers (tests/unit/conftest.py groups its tests by file, the longest file first).
Nothing is skipped or shortened: every test of both sessions runs, and the run fails if either
session fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNIT_WORKERS = "2"


def unit_command() -> list[str]:
    """The unit suite on two workers, groups handed out longest first."""
    return [sys.executable, "-m", "pytest", "tests/unit", "-q", "-p", "no:cacheprovider", "-n", UNIT_WORKERS,
            "--dist", "loadgroup", "--durations=15"]


def main() -> int:
    """Runs both sessions; prints the distributed one's output after the unit suite's; 0 only if
    both passed."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dtmega-suite-") as scratch:
        log_path = Path(scratch, "distributed.log")
        with open(log_path, "w") as log:
            distributed = subprocess.Popen([sys.executable, str(ROOT / "tests" / "distributed_session.py")],
                                           cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
            try:
                unit = subprocess.run(unit_command(), cwd=ROOT).returncode
            except KeyboardInterrupt:
                distributed.terminate()
                raise
            unit_minutes = (time.monotonic() - started) / 60
            print(f"\n===== unit suite: {'passed' if unit == 0 else 'FAILED'} after {unit_minutes:.1f} min; "
                  "the distributed session (4 ranks, started alongside) =====", flush=True)
            code = distributed.wait()
        sys.stdout.write(log_path.read_text(errors="replace"))
    total = (time.monotonic() - started) / 60
    print(f"\n===== unit suite {'passed' if unit == 0 else 'FAILED'}, distributed session "
          f"{'passed' if code == 0 else 'FAILED'}; {total:.1f} min in all =====", flush=True)
    return 0 if unit == 0 and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
