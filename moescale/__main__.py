"""`python -m moescale ...` (and `torchrun -m moescale ...`) runs the command line."""

import sys

from moescale.cli import main

sys.exit(main())
