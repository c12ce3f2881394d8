"""Scripted swarms for the multi-process tests: a run dir that is torn down whatever happens."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from dtfm.swarm import cli as swarm


@contextmanager
def swarm_up(prefix: str, *, scenario: str = "worldwide", peers: int = 8, timeout_s: int = 240):
    """`dtfm-swarm up` in a fresh run dir (short: the control sockets live inside it); every
    peer is killed and the dir removed on the way out."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        assert swarm.main(["up", "--run-dir", str(d), "--scenario", scenario, "--peers", str(peers),
                           "--timeout", str(timeout_s)]) == 0
        yield d
    finally:
        try:
            swarm.main(["down", "--run-dir", str(d), "--kill"])
        finally:
            shutil.rmtree(d, ignore_errors=True)
