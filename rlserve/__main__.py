import sys

from rlserve.cli import main

sys.exit(main())
