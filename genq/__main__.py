import sys

from genq.cli import main

sys.exit(main())
