"""How many runs the long stateful property tests draw (the simulated swarms of the control
plane and the election): half their full count in the default suite, which CI runs within its
minutes; the full count with DTFM_THOROUGH=1, run by hand before a change to the machines lands
(`DTFM_THOROUGH=1 pytest tests/control`). Derandomized, so either count is the same runs every
time."""

import os

THOROUGH = os.environ.get("DTFM_THOROUGH") == "1"


def examples(full: int) -> int:
    """`full` with DTFM_THOROUGH=1, else half of it (at least 5)."""
    return full if THOROUGH else max(5, full // 2)
