"""The distributed runner's verdict (tests/distributed_session.py), without torchrun.

The runner once returned only the rerun's status after a native crash, so a test that failed
before the crash could pass on its second chance and the run went green. `judge` and `outcome`
are pure functions of what each rank wrote; `main` is driven here by a fake session that writes
those records as tests/distributed/conftest.py does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import distributed_session as runner
from tests.distributed_session import RANKS, RankRecord, judge, outcome

A, B, C, D = (f"tests/distributed/test_x.py::test_{name}" for name in "abcd")


def ranks(**by_rank: RankRecord) -> list[RankRecord]:
    """RANKS records: the given ones (r0=..., r3=...), every other rank ran A..D and passed them."""
    clean = RankRecord(started=(A, B, C, D), passed=(A, B, C, D))
    return [by_rank.get(f"r{rank}", clean) for rank in range(RANKS)]


def test_a_clean_session_passes():
    verdict = judge(0, ranks())
    assert verdict.ok and not verdict.rerun
    assert outcome(verdict, None) == 0


def test_a_failure_without_a_crash_fails_with_its_name_and_ranks():
    failing = RankRecord(started=(A, B, C, D), passed=(A, C, D), failed=(B, B))  # call and teardown
    verdict = judge(1, ranks(r2=failing))
    assert verdict.failed == {B: [2]} and not verdict.rerun
    assert outcome(verdict, None) == 1


def test_a_failure_recorded_under_exit_status_0_still_fails():
    verdict = judge(0, ranks(r1=RankRecord(started=(A,), failed=(A,))))
    assert outcome(verdict, None) == 1


def test_a_failure_before_a_crash_fails_the_run_even_when_the_rerun_passes():
    """The issue's case: B fails on rank 0, rank 1 dies in D; the rerun of C and D passes."""
    dead = RankRecord(started=(A, B, C, D), passed=(A, B, C), crashed=True)
    verdict = judge(-11, ranks(r0=RankRecord(started=(A, B, C, D), passed=(A, C), failed=(B,)), r1=dead))
    assert verdict.rerun and verdict.failed == {B: [0]} and verdict.crashed == [1]
    assert set(verdict.finished) == {A, B, C}  # D did not finish: rerun; B failed: not given a second chance
    rerun = judge(0, [RankRecord(started=(D,), passed=(D,))] * RANKS)
    assert rerun.ok
    assert outcome(verdict, rerun) == 1


def test_failures_a_crash_causes_are_rerun_not_counted():
    """Rank 3 dies in C: the live ranks' collectives in C and D fail against the dead peer."""
    dead = RankRecord(started=(A, B, C), passed=(A, B), crashed=True)
    live = RankRecord(started=(A, B, C, D), passed=(A, B), failed=(C, D))
    verdict = judge(1, [live, live, live, dead])
    assert verdict.failed == {} and verdict.at_crash == {C: [0, 1, 2], D: [0, 1, 2]}
    assert verdict.finished == [A, B]
    assert outcome(verdict, judge(0, [RankRecord(started=(C, D), passed=(C, D))] * RANKS)) == 0


def test_a_rerun_that_fails_or_crashes_fails_the_run():
    verdict = judge(-11, ranks(r1=RankRecord(started=(A, B), passed=(A,), crashed=True)))
    failing = judge(1, ranks(r0=RankRecord(started=(B, C, D), passed=(C, D), failed=(B,))))
    crashing = judge(-11, ranks(r2=RankRecord(started=(B,), crashed=True)))
    assert outcome(verdict, failing) == 1 and outcome(verdict, crashing) == 1
    assert outcome(verdict, None) == 1


def test_a_rank_without_records_reruns_everything():
    """A rank that died before it wrote anything (or fewer records than ranks): nothing is
    known to have passed everywhere, so everything is rerun."""
    verdict = judge(-11, ranks(r3=RankRecord(crashed=True)))
    assert verdict.rerun and verdict.finished == [] and verdict.failed == {}


def _fake_session(sessions: list[tuple[int, list[RankRecord]]], skips: list[set[str]]):
    """A stand-in for `_session` that writes each rank's files as the distributed conftest does."""
    def session(crash_dir: Path, env, skip_finished: Path | None) -> int:
        skips.append(set(skip_finished.read_text().splitlines()) if skip_finished else set())
        code, records = sessions.pop(0)
        crash_dir.mkdir(parents=True)
        for rank, record in enumerate(records):
            for kind in ("started", "passed", "failed"):
                (crash_dir / f"{kind}-rank{rank}.txt").write_text("".join(f"{n}\n" for n in getattr(record, kind)))
            (crash_dir / f"rank{rank}.txt").write_text("Fatal Python error: Segmentation fault\n" if record.crashed else "")
        return code
    return session


def test_main_fails_a_crashed_run_whose_rerun_passed_and_names_the_failure(monkeypatch, capsys):
    dead = RankRecord(started=(A, B, C), passed=(A, B), crashed=True)
    first = ranks(r0=RankRecord(started=(A, B, C, D), passed=(A,), failed=(B,)), r2=dead)
    sessions = [(-11, first), (0, [RankRecord(started=(C, D), passed=(C, D))] * RANKS)]
    skips: list[set[str]] = []
    monkeypatch.setattr(runner, "_session", _fake_session(sessions, skips))
    assert runner.main({}) == 1
    assert skips == [set(), {A, B}]  # the rerun skips what passed everywhere and what failed
    out = capsys.readouterr().out
    assert f"FAILED {B} (rank 0)" in out and "rank2 died of a signal" in out and "the run FAILED" in out


@pytest.mark.parametrize("code", [0, 1])
def test_main_without_a_crash_returns_the_verdict(monkeypatch, capsys, code):
    records = ranks(r1=RankRecord(started=(A,), failed=(A,))) if code else ranks()
    monkeypatch.setattr(runner, "_session", _fake_session([(code, records)], []))
    assert runner.main({}) == code
    assert (f"FAILED {A} (rank 1)" in capsys.readouterr().out) == bool(code)
