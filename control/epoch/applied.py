"""What a peer keeps of the epochs it applied, across a restart: the seam between the plane's
shell and its data dir, as `ElectionStore` is the election's (a file version for the daemon, a
memory version for tests).

- applied.json: the last allocation this peer applied (its run, term and epoch, and the
  allocation itself), and the voters before the last change of the council (`previous`, which a
  restarted voter needs to recognise a certificate of the old configuration). Written durably
  (a temporary file, fsynced, renamed) before anything follows the application; a damaged file
  stops the daemon, since applying an older allocation again could break the allocation floor.
- stopped.json: the operator's stop of a run, so that a peer restarted after `train stop` still
  counts the run as over: neither it, as coordinator, nor its run state brings the run back
  without an operator's `train resume`. Forgotten once a new epoch of that run is applied. A
  damaged file is ignored with a warning (the run then counts as not stopped, as before the
  file existed).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dtfm.files import atomic_write
from dtfm.net import ProtocolError

from ..allocation import Allocation
from ..election import PreviousConfiguration

__all__ = ["APPLIED_NAME", "STOPPED_NAME", "Applied", "AppliedError", "AppliedStore", "FileAppliedStore",
           "MemoryAppliedStore"]

APPLIED_NAME = "applied.json"
STOPPED_NAME = "stopped.json"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Applied:
    """The last allocation this peer applied, as it kept it."""

    run_id: bytes
    term: int
    epoch: int
    alloc: Allocation | None  # (None: kept by a version that did not keep the allocation)
    previous: PreviousConfiguration | None


class AppliedError(ValueError):
    """The kept allocation is damaged; the message says which file and what to do."""


class AppliedStore(Protocol):
    def load(self) -> Applied | None:
        """The allocation kept, None: none (AppliedError when it is damaged)."""

    def save(self, alloc: Allocation, previous: PreviousConfiguration | None) -> None:
        """Keep `alloc` as applied (durably, before it returns); a stop of its run is
        forgotten (a new epoch of it: it was resumed)."""

    def stopped(self) -> bytes | None:
        """The run an operator stopped, None: none."""

    def save_stopped(self, run_id: bytes) -> None:
        """Keep the operator's stop of `run_id` (durably)."""


def _write(path: Path, text: str) -> None:
    atomic_write(path, text)


def applied_json(alloc: Allocation, previous: PreviousConfiguration | None) -> str:
    return json.dumps({"run": alloc.run_id.hex(), "term": alloc.term, "epoch": alloc.epoch,
                       "allocation": alloc.encode().hex(),
                       "previous": None if previous is None else {"voters": [v.hex() for v in previous.voters],
                                                                  "term": previous.term}})


def parse_applied(text: str, where: str) -> Applied:
    """applied.json's content; AppliedError naming `where` when it is damaged."""
    try:
        d = json.loads(text)
        run, term, epoch = bytes.fromhex(d["run"]), int(d["term"]), int(d["epoch"])
    except (ValueError, KeyError, TypeError) as e:
        raise AppliedError(f"{where} is damaged ({e}): move it away only if this peer never trains again "
                           "in the same swarm") from None
    alloc = None
    body = d.get("allocation")
    if isinstance(body, str):
        try:
            alloc = Allocation.decode(bytes.fromhex(body))
        except (ValueError, ProtocolError) as e:
            raise AppliedError(f"{where} holds a damaged allocation ({e})") from None
    previous = None
    prev = d.get("previous")
    if isinstance(prev, dict):
        try:
            previous = PreviousConfiguration(tuple(bytes.fromhex(v) for v in prev["voters"]), int(prev["term"]))
        except (ValueError, KeyError, TypeError) as e:
            raise AppliedError(f"{where} holds a damaged previous configuration ({e})") from None
    return Applied(run, term, epoch, alloc, previous)


class FileAppliedStore:
    """applied.json and stopped.json in a data dir."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)

    def load(self) -> Applied | None:
        path = self.data_dir / APPLIED_NAME
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise AppliedError(f"{path} is damaged ({e}): move it away only if this peer never trains again "
                               "in the same swarm") from None
        return parse_applied(text, str(path))

    def save(self, alloc: Allocation, previous: PreviousConfiguration | None) -> None:
        _write(self.data_dir / APPLIED_NAME, applied_json(alloc, previous))
        if self.stopped() == alloc.run_id:
            (self.data_dir / STOPPED_NAME).unlink(missing_ok=True)

    def stopped(self) -> bytes | None:
        path = self.data_dir / STOPPED_NAME
        try:
            run = json.loads(path.read_text())["run"]
            return bytes.fromhex(run) if isinstance(run, str) and len(run) == 32 else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("%s is damaged (%s): ignored", path, e)
            return None

    def save_stopped(self, run_id: bytes) -> None:
        _write(self.data_dir / STOPPED_NAME, json.dumps({"run": run_id.hex()}))


class MemoryAppliedStore:
    """The same in memory (a restart within one test keeps it; nothing is written)."""

    def __init__(self) -> None:
        self.applied: Applied | None = None
        self._stopped: bytes | None = None

    def load(self) -> Applied | None:
        return self.applied

    def save(self, alloc: Allocation, previous: PreviousConfiguration | None) -> None:
        self.applied = Applied(alloc.run_id, alloc.term, alloc.epoch, alloc, previous)
        if self._stopped == alloc.run_id:
            self._stopped = None

    def stopped(self) -> bytes | None:
        return self._stopped

    def save_stopped(self, run_id: bytes) -> None:
        self._stopped = run_id
