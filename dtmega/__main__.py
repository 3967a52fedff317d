"""`python -m dtmega ...` is the `dtmega` command."""

from dtmega.cli import entry

entry()
