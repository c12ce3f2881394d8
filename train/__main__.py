"""python -m dtfm.train: see dtfm.train.cli."""

import sys

from .cli import main

sys.exit(main())
