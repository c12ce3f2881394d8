"""`python -m dtfm.peer`: the same as the `dtfm-peer` command."""

import sys

from .cli import main

sys.exit(main())
