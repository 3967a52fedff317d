"""Runs the distributed suite: one 4-rank torchrun pytest session on CPU/gloo.

    .venv/bin/python tests/distributed_session.py      (`make test-distributed`; `make test` runs it last)

torchrun runs `--standalone` (its rendezvous on a free port): two sessions on one machine, or a
session beside a training job, never meet on the default port 29500. A test that fails fails
the run, crash or no crash. A rank that dies of a signal is another matter: the suite has seen
a rare native crash (SIGSEGV, about one session in eight, at a different test each time, never
reproduced by rerunning that test; docs/testing.md "Native crashes"). When that happens this
runner prints the dead rank's Python stacks (faulthandler, written by
tests/distributed/conftest.py to DTMEGA_TEST_CRASH_DIR) and runs the tests the crashed session
had not finished once more, in a fresh session.

The verdict is `judge` (a pure function of what each rank wrote: the tests it started, passed
and failed, and whether it died; tests/unit/test_distributed_session.py): a test that failed
before the crash fails the run whatever the rerun does, and is not rerun; a failure at or after
the crash (a live rank's collective that lost its dead peer) is the crash's, and that test is
rerun with the rest. A second crash, or any failure in the rerun, fails the run too. Every
failed test is printed by name, with its ranks, at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANKS = 4


@dataclass(frozen=True)
class RankRecord:
    """What one rank wrote to the crash directory (tests/distributed/conftest.py, `_note`)."""

    started: tuple[str, ...] = ()  # the tests it began, in order
    passed: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()  # the tests with a failed phase (setup, call or teardown)
    crashed: bool = False  # it died of a signal (faulthandler wrote its stacks)


@dataclass(frozen=True)
class Verdict:
    """One session judged: what failed (fails the run), what failed because of the crash (rerun),
    and what a rerun skips."""

    returncode: int
    failed: dict[str, list[int]] = field(default_factory=dict)  # test -> the ranks it failed on
    at_crash: dict[str, list[int]] = field(default_factory=dict)  # failures the crash caused: rerun
    crashed: list[int] = field(default_factory=list)  # the ranks that died of a signal
    finished: list[str] = field(default_factory=list)  # passed on every rank, or failed: not rerun

    @property
    def rerun(self) -> bool:
        """A native crash: the tests that did not finish run once more in a fresh session."""
        return bool(self.crashed) and self.returncode != 0

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.failed and not self.crashed


def judge(returncode: int, ranks: list[RankRecord]) -> Verdict:
    """The verdict on one session from torchrun's exit status and every rank's record.

    Without a crash every recorded failure counts. After a crash, a failure counts when every
    crashed rank had got past that test (started a later one): ranks wait for each other after
    every test, so the test was over everywhere before the crash. A failure at the crashed
    rank's last test, or after it, is what a dead peer does to a collective: rerun, not counted."""
    crashed = [rank for rank, record in enumerate(ranks) if record.crashed]
    failures: dict[str, list[int]] = {}
    for rank, record in enumerate(ranks):
        for nodeid in dict.fromkeys(record.failed):
            failures.setdefault(nodeid, []).append(rank)
    if not crashed or returncode == 0:
        return Verdict(returncode, failed=failures, crashed=crashed)
    got_past = set.intersection(*(set(ranks[rank].started[:-1]) for rank in crashed))
    failed = {nodeid: on for nodeid, on in failures.items() if nodeid in got_past}
    at_crash = {nodeid: on for nodeid, on in failures.items() if nodeid not in got_past}
    everywhere = set.intersection(*(set(record.passed) for record in ranks)) if len(ranks) == RANKS else set()
    finished = [nodeid for nodeid in ranks[0].passed if nodeid in everywhere] + list(failed)
    return Verdict(returncode, failed=failed, at_crash=at_crash, crashed=crashed, finished=finished)


def outcome(first: Verdict, rerun: Verdict | None) -> int:
    """The run's exit status: 0 only when no test failed in either session, and the session (or,
    after a crash in the first, its rerun) ended cleanly."""
    if first.failed or (rerun is not None and rerun.failed):
        return 1
    if first.rerun:
        return 0 if rerun is not None and rerun.ok else 1
    return first.returncode


def _read(path: Path) -> tuple[str, ...]:
    return tuple(path.read_text().splitlines()) if path.exists() else ()


def read_records(crash_dir: Path) -> list[RankRecord]:
    """Every rank's record (a rank that wrote nothing has an empty one)."""
    return [RankRecord(started=_read(crash_dir / f"started-rank{rank}.txt"),
                       passed=_read(crash_dir / f"passed-rank{rank}.txt"),
                       failed=_read(crash_dir / f"failed-rank{rank}.txt"),
                       crashed=bool(_read(crash_dir / f"rank{rank}.txt")))
            for rank in range(RANKS)]


def crash_stacks(crash_dir: Path) -> dict[str, str]:
    """The faulthandler output of every rank that died of a signal (empty files are live ranks)."""
    stacks = {}
    for path in sorted(crash_dir.glob("rank*.txt")):
        text = path.read_text(errors="replace").strip()
        if text:
            stacks[path.stem] = text
    return stacks


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


def _print_stacks(crash_dir: Path, title: str) -> None:
    for rank, text in crash_stacks(crash_dir).items():
        print(f"\n===== {title}{rank} died of a signal; its stacks (faulthandler) =====\n{text}", flush=True)


def _report(first: Verdict, rerun: Verdict | None, code: int) -> None:
    """Names every failed test, with its ranks, and says how the run ended."""
    def ranks(on: list[int]) -> str:
        return f"rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))}"

    for title, verdict in (("", first), ("the rerun: ", rerun)):
        if verdict is None:
            continue
        for nodeid, on in verdict.failed.items():
            print(f"{title}FAILED {nodeid} ({ranks(on)})", flush=True)
        for nodeid, on in verdict.at_crash.items():
            print(f"{title}failed at the crash, so rerun: {nodeid} ({ranks(on)})", flush=True)
    if first.rerun:
        print(f"\n===== the first session crashed (rank {', '.join(map(str, first.crashed))}; stacks above); "
              f"{len(first.failed)} tests failed before the crash; the rerun "
              f"{'passed' if rerun is not None and rerun.ok else 'FAILED'}: the run "
              f"{'passed' if code == 0 else 'FAILED'} =====", flush=True)
    elif code and first.returncode == 0:
        print("\n===== tests failed although the session exited 0: the run FAILED =====", flush=True)


def main(env: dict[str, str] | None = None) -> int:
    """Runs the session; on a native crash, prints the stacks and reruns what had not finished."""
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="dtmega-dist-") as scratch:
        first_dir = Path(scratch, "first")
        first = judge(_session(first_dir, env, None), read_records(first_dir))
        rerun = None
        if first.rerun:
            _print_stacks(first_dir, "")
            skip = first_dir / "finished.txt"
            skip.write_text("".join(f"{nodeid}\n" for nodeid in first.finished))
            print(f"\n===== native crash after {len(first.finished)} finished tests ({len(first.failed)} failed, "
                  f"and fail the run): rerunning the rest once in a fresh session (docs/testing.md, "
                  f"'Native crashes') =====", flush=True)
            second_dir = Path(scratch, "second")
            rerun = judge(_session(second_dir, env, skip), read_records(second_dir))
            _print_stacks(second_dir, "rerun: ")
        code = outcome(first, rerun)
        _report(first, rerun, code)
        return code


if __name__ == "__main__":
    sys.exit(main())
