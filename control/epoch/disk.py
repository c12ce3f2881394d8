"""This peer's checkpoints on disk: where they go, how many stay, what they cost, and a write
the disk refuses.

`CheckpointDisk` owns `DATA_DIR/checkpoints/`: one folder per run (so a run never takes another
run's checkpoint for its own), in it the newest `kept` checkpoints of each stage (older ones
are deleted as a new one lands); the folders of the newest `runs_kept` runs stay (by their
last write), older runs' are deleted as a checkpoint of another run lands, so the disk a peer
uses is bounded across runs too. Every checkpoint this peer writes goes through `save`: the
runner's periodic and final ones (worker thread) and the stages a waiting run keeps (`keep`,
control/epoch/stages.py). A write the disk refuses (full, read-only, gone) is a refusal to
checkpoint, logged at ERROR and kept for `status`, never a dead daemon or a corrupt file:
`save_checkpoint` leaves no part of a failed write behind (train/checkpoint.py), and training
goes on with the stage in memory. `bytes` is what the folder holds, for `dtfm-peer status`.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dtfm.train import StageState

__all__ = ["CheckpointDisk", "DiskStatus"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiskStatus:
    """What `status` shows of this peer's checkpoints."""

    path: str  # DATA_DIR/checkpoints
    bytes: int  # what every checkpoint there holds, all runs together
    kept: int  # checkpoints kept per stage of each run
    runs_kept: int  # runs whose checkpoints stay, the newest
    saved: int  # checkpoints written by this daemon
    refused: int  # writes the disk refused
    refusal: str | None  # the last refused write and why; None once a later write succeeded
    refused_at: float | None  # its wall time

    def to_wire(self) -> dict:
        out: dict = {"path": self.path, "bytes": self.bytes, "kept": self.kept, "runs_kept": self.runs_kept,
                     "saved": self.saved, "refused": self.refused}
        if self.refusal is not None:
            out.update(refusal=self.refusal, refused_at=self.refused_at)
        return out


class CheckpointDisk:
    """This peer's checkpoint folder (see the module docstring). `save` may be called from any
    thread; writes are serialised."""

    def __init__(self, root: Path, kept: int = 3, runs_kept: int = 4):
        if kept < 1 or runs_kept < 1:
            raise ValueError("kept and runs_kept must be at least 1")
        self.root, self.kept, self.runs_kept = Path(root), kept, runs_kept
        self._lock = threading.Lock()
        self._saved = self._refused = 0
        self._refusal: str | None = None
        self._refused_at: float | None = None
        self._bytes = folder_bytes(self.root)

    def run_root(self, run_id: bytes) -> Path:
        return self.root / run_id.hex()

    def save(self, run_id: bytes, state: StageState, notes: dict | None = None) -> Path | None:
        """Write `state` as run `run_id`'s checkpoint of its layers at its step, keeping the
        newest `kept`; the JSON path, or None when the disk refused (logged, in `status`).
        Blocking."""
        from dtfm.train import save_checkpoint  # (torch: only a peer that holds a stage writes one)

        with self._lock:
            try:
                path = save_checkpoint(self.run_root(run_id), state, keep=self.kept, notes=notes)
            except OSError as e:
                why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
                a, b = state.layer_range
                self._refusal = (f"no checkpoint of layers {a}-{b - 1} at step {state.step}: {why} "
                                 f"({self.root}); the stage stays in memory only: free space there")
                self._refused += 1
                self._refused_at = time.time()
                self._bytes = folder_bytes(self.root)
                logger.error("refusing to checkpoint: %s", self._refusal)
                return None
            self._saved += 1
            self._refusal = self._refused_at = None
            self._prune_runs(self.run_root(run_id))
            self._bytes = folder_bytes(self.root)
            return path

    def _prune_runs(self, current: Path) -> None:
        """Delete the folders of the runs older than the newest `runs_kept` (`current`, just
        written, among them), the age of a run its newest write."""
        try:
            runs = [p for p in self.root.iterdir() if p.is_dir() and p != current]
        except OSError:
            return
        runs.sort(key=last_write, reverse=True)
        for old in runs[self.runs_kept - 1:]:
            shutil.rmtree(old, ignore_errors=True)
            logger.info("deleted the checkpoints of run %s: only the newest %d runs' stay", old.name[:8],
                        self.runs_kept)

    def status(self) -> DiskStatus:
        return DiskStatus(str(self.root), self._bytes, self.kept, self.runs_kept, self._saved, self._refused,
                          self._refusal, self._refused_at)


def folder_bytes(root: Path) -> int:
    """The bytes of every file under `root` (0 when it does not exist)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:  # (deleted meanwhile)
                pass
    return total


def last_write(folder: Path) -> float:
    """The newest modification time of `folder` and the folders in it (a run's folder holds one
    per stage, whose times change as checkpoints land); 0 when it is gone."""
    try:
        return max([folder.stat().st_mtime] + [p.stat().st_mtime for p in folder.iterdir() if p.is_dir()])
    except OSError:
        return 0.0
