"""The operator's stop of a run, kept in the data dir (`stopped.json`), so that a peer
restarted after `train stop` still counts the run as over: neither it, as coordinator, nor its
run state brings the run back without an operator's `train resume`. Written atomically (a
temporary file, fsynced, renamed), removed once a new epoch of that run is applied.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

__all__ = ["STOPPED_NAME", "clear_stopped", "load_stopped", "save_stopped"]

STOPPED_NAME = "stopped.json"

logger = logging.getLogger(__name__)


def save_stopped(data_dir: Path, run_id: bytes) -> None:
    path = data_dir / STOPPED_NAME
    tmp = path.with_name(f".{STOPPED_NAME}.tmp")
    with open(tmp, "w") as f:
        json.dump({"run": run_id.hex()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_stopped(data_dir: Path) -> bytes | None:
    """The run an operator stopped, None: none (a damaged file is ignored with a warning: the
    run then counts as not stopped, as before the file existed)."""
    path = data_dir / STOPPED_NAME
    try:
        run = json.loads(path.read_text())["run"]
        return bytes.fromhex(run) if isinstance(run, str) and len(run) == 32 else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("%s is damaged (%s): ignored", path, e)
        return None


def clear_stopped(data_dir: Path, run_id: bytes) -> None:
    """Forget the stop of `run_id` (a new epoch of it was applied: it was resumed)."""
    if load_stopped(data_dir) == run_id:
        (data_dir / STOPPED_NAME).unlink(missing_ok=True)
