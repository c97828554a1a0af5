"""Entry point for `python -m genq.simulator`."""

import sys

from genq.simulator.cli import main

sys.exit(main())
