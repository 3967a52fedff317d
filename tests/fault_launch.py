"""`dtmega <command> ...` with a fault injected into one rank, for the hang-free tests:

    torchrun --nproc-per-node 2 tests/fault_launch.py late-join|stall-data RANK dtmega-args...

late-join: rank RANK starts 60 s late (a node that never arrives in time);
stall-data: rank RANK hangs for 60 s fetching its third batch (a stuck filesystem);
slow-data: rank RANK takes 0.2 s longer to fetch every batch (a slow disk: a straggler);
missing-data: rank RANK's --data-path names nothing (a node without the data), and every rank
runs as the console script does (`dtmega.cli.entry`: failures go to the launch's store);
as-launched: no fault injected, every rank runs as the console script does.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
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
    if fault in ("missing-data", "as-launched"):
        if fault == "missing-data" and me == victim:
            argv[argv.index("--data-path") + 1] += "-not-on-this-node"
        from dtmega.cli import entry

        sys.argv = ["dtmega", *argv]
        entry()  # ends the process
    from dtmega.cli import main as dtmega

    return dtmega(argv)


if __name__ == "__main__":
    sys.exit(main())
