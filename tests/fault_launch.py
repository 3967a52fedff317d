"""`dtmega <command> ...` with a fault injected into one rank, for the hang-free tests:

    torchrun --nproc-per-node 2 tests/fault_launch.py FAULT RANK dtmega-args...

late-join: rank RANK starts 60 s late (a node that never arrives in time);
stall-data: rank RANK hangs for 60 s fetching its third batch (a stuck filesystem);
slow-data: rank RANK takes 0.2 s longer to fetch every batch (a slow disk: a straggler);
missing-data: rank RANK's --data-path names nothing (a node without the data);
missing-data-peer-importing: as missing-data, and the other ranks' import of the command's module
takes 12 s longer (a peer still starting when torchrun stops it because RANK failed);
as-launched: no fault injected.

Every rank runs as the console script does (`dtmega.cli.entry`: a failure goes to the launch's
store, and the process ends as the console script ends it).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    fault, victim, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    me = int(os.environ["RANK"])
    if fault == "late-join" and me == victim:
        time.sleep(60)
    elif fault in ("stall-data", "slow-data"):
        from dtmega.data.loader import BatchLoader

        fetch, calls = BatchLoader.__next__, [0]

        def stalling(self):
            calls[0] += 1
            if me == victim and (fault == "slow-data" or calls[0] == 3):
                time.sleep(0.2 if fault == "slow-data" else 60)
            return fetch(self)

        BatchLoader.__next__ = stalling
    if fault in ("missing-data", "missing-data-peer-importing", "as-launched"):
        if fault.startswith("missing-data") and me == victim:
            argv[argv.index("--data-path") + 1] += "-not-on-this-node"
        if fault == "missing-data-peer-importing" and me != victim:
            import importlib

            load = importlib.import_module

            def slow_import(name, package=None):
                if name.startswith("dtmega.train"):
                    time.sleep(12)  # PEP 475: a signal whose handler returns does not cut the sleep short
                return load(name, package)

            importlib.import_module = slow_import
    # Every rank runs as the console script does and ends as it ends (without interpreter
    # finalization once a process group existed: ending through `sys.exit` with the groups' gloo
    # threads alive sometimes aborts, which failed a straggler run that had finished its training).
    from dtmega.cli import entry

    sys.argv = ["dtmega", *argv]
    entry()


if __name__ == "__main__":
    main()
