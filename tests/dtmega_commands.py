"""Runs several one-process `dtmega` command lines in one Python process, in order: the docs'
`dtmega preprocess|train --dry-run|evaluate|generate` lines, each through the entry point the
console script runs (`dtmega.cli.main`, inside `entry`), so one interpreter start (~3 s of imports on the CI
machine) serves them all. Each command's output follows a `$ dtmega ...` header; the exit
status is the first failure's (0 if none), and the commands after it are not run.

    python tests/dtmega_commands.py '[["preprocess", "--input", "data.jsonl", ...], ["evaluate", ...]]'
"""

from __future__ import annotations

import json
import shlex
import sys

from dtmega.cli import main


def run_all(commands: list[list[str]]) -> int:
    """Each command through the dtmega entry point, in order; stops at the first failure."""
    for argv in commands:
        print(f"$ dtmega {shlex.join(argv)}", flush=True)
        status = main(argv)
        if status:
            print(f"exit status {status}: dtmega {shlex.join(argv)}", file=sys.stderr, flush=True)
            return status
    return 0


if __name__ == "__main__":
    sys.exit(run_all(json.loads(sys.argv[1])))
