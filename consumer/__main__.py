import sys

from genq.consumer.cli import main

sys.exit(main())
