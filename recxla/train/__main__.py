"""`python -m recxla.train`: see recxla.train.cli."""

import sys

from recxla.train.cli import main

sys.exit(main())
