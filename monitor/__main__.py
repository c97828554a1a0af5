"""`python -m monitor`: the same service as `genq monitor`."""

import sys

from monitor.cli import main

sys.exit(main())
