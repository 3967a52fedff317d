"""`python -m dtmega ...` is the `dtmega` command."""

import sys

from dtmega.cli import main

sys.exit(main())
