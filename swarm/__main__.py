"""`python -m dtfm.swarm`: the same as the `dtfm-swarm` command."""

import sys

from .cli import main

sys.exit(main())
