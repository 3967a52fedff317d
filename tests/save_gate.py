"""A checkpoint gate for tests that kill a rank mid-run: each rank of a `dtmega train` subprocess
holds, once, right after it has saved iteration `at`, until the test releases it.

Waiting for a checkpoint file to appear and then killing is a race: on a fast machine the job can
save again, or finish, between two polls (CI saw a 2-node job end before the test noticed its
second save). With the gate the job is known to stand still at a chosen step while the test kills.

It is injected from outside, as a `sitecustomize` on the workers' PYTHONPATH (dtmega carries no
test hook): an import hook wraps `Trainer.save` when `dtmega.train.trainer` is first imported.
Only a process whose environment has DTMEGA_TEST_GATE (the gate directory) is held.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

GATE_SITECUSTOMIZE = '''
import importlib.abc, importlib.util, os, sys, time

def _hold_after_save(trainer_module):
    gate, at = os.environ["DTMEGA_TEST_GATE"], int(os.environ["DTMEGA_TEST_GATE_AT"])
    save = trainer_module.Trainer.save

    def held_save(self, *args, **kwargs):
        path = save(self, *args, **kwargs)
        marker = os.path.join(gate, f"held-rank{os.environ.get('RANK', '0')}")
        if self.iteration == at and not os.path.exists(marker):
            open(marker, "w").close()
            deadline = time.monotonic() + 300
            while not os.path.exists(os.path.join(gate, "release")) and time.monotonic() < deadline:
                time.sleep(0.05)
        return path

    trainer_module.Trainer.save = held_save

class _GateFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "dtmega.train.trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_then_gate(module):
            run(module)
            _hold_after_save(module)

        spec.loader.exec_module = exec_then_gate
        return spec

if os.environ.get("DTMEGA_TEST_GATE"):
    sys.meta_path.insert(0, _GateFinder())
'''


def make_gate(directory: Path, extra_sitecustomize: str = "") -> Path:
    """Writes the gate's `sitecustomize.py` (plus `extra_sitecustomize`, for a test that has its
    own) into `directory` and returns it: put it first on PYTHONPATH and in DTMEGA_TEST_GATE."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(extra_sitecustomize + "\n" + GATE_SITECUSTOMIZE)
    return directory


def gate_env(directory: Path, at: int) -> dict[str, str]:
    """The environment entries that hold every rank after its save of iteration `at`."""
    return {"DTMEGA_TEST_GATE": str(directory), "DTMEGA_TEST_GATE_AT": str(at)}


def wait_until_held(directory: Path, ranks: int, launchers: list[subprocess.Popen], log: Path,
                    seconds: float = 240) -> None:
    """Returns once `ranks` ranks stand at the gate; fails, with the job's log, if a launcher
    exits first or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while len(list(directory.glob("held-rank*"))) < ranks:
        alive = all(launcher.poll() is None for launcher in launchers)
        assert alive and time.monotonic() < deadline, f"the job never reached the gate:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def release(directory: Path) -> None:
    """Lets every held rank go on."""
    (directory / "release").touch()
