import sys

from genq.producer.cli import main

sys.exit(main())
