import sys

from genq.monitor.cli import main

sys.exit(main())
