"""The `dtmega` command tells input errors from bugs: a DtmegaError (every input check's error:
PlanError, ArgumentError, CheckpointError, MissingInput, ...) is one line and exit 2; any other
exception is a bug and keeps its traceback (exit 1). It used to catch every ValueError, so an
internal bug printed as a user error without a traceback."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from dtmega.cli import main
from dtmega.kernels.errors import DtmegaError, MissingInput
from dtmega.passes import PlanError
from dtmega.train.args import ArgumentError


def _command_raising(monkeypatch, error: BaseException) -> None:
    fake = types.ModuleType("fake_command")

    def run(argv):
        raise error

    fake.main = run
    monkeypatch.setitem(sys.modules, "dtmega.cost.plan_cli", fake)


def test_every_input_error_is_a_dtmega_error():
    assert issubclass(PlanError, DtmegaError) and issubclass(ArgumentError, DtmegaError)
    assert issubclass(MissingInput, FileNotFoundError) and issubclass(DtmegaError, ValueError)


def test_an_input_error_is_one_line_and_exit_2(monkeypatch, capsys):
    _command_raising(monkeypatch, ArgumentError("--lr -1: must be positive. Fix: --lr 3e-4"))
    assert main(["plan"]) == 2
    err = capsys.readouterr().err
    assert "dtmega plan: --lr -1: must be positive. Fix: --lr 3e-4" in err and "Traceback" not in err


def test_a_bug_keeps_its_traceback(monkeypatch):
    _command_raising(monkeypatch, ValueError("an internal bug"))
    with pytest.raises(ValueError, match="an internal bug"):
        main(["plan"])


def test_the_console_command_exits_1_with_the_traceback_of_a_bug(tmp_path):
    script = ("import sys, types; m = types.ModuleType('x'); m.main = lambda argv: int('not a number'); "
              "sys.modules['dtmega.cost.plan_cli'] = m; sys.argv = ['dtmega', 'plan']; "
              "from dtmega.cli import entry; entry()")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" in done.stderr and "invalid literal for int()" in done.stderr
