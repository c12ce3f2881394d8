"""Durable term and vote of the election: what a `Persist` action writes, and what a
restarted peer loads.

`FileElectionStore` keeps one small JSON file, replaced atomically: the new content goes to a
temporary file in the same directory, which is fsynced, renamed over the old one, and the
directory is fsynced, so after a crash the file holds the old or the new state, never a mix,
and a vote once persisted survives power loss. A file that cannot be read is an error, not a
fresh start: forgetting a vote could grant a second one in the same term.

`MemoryElectionStore` has the same interface, for simulations and tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dtfm.files import atomic_write
from dtfm.net import PEER_ID_BYTES

from .messages import MAX_TERM

__all__ = ["ELECTION_FILE", "ElectionStore", "ElectionStoreError", "FileElectionStore", "MemoryElectionStore",
           "persist_problem"]

ELECTION_FILE = "election.json"
FORMAT_VERSION = 1
MAX_FILE_BYTES = 4096


class ElectionStoreError(Exception):
    """The stored term and vote cannot be read or written; the message says what to do."""


def persist_problem(term: object, voted_for: object) -> str | None:
    """Why a store refuses to write (term, voted_for), or None: what the service checks before
    it queues a Persist, so a refusal is a refused input rather than an exception."""
    if type(term) is not int or not 0 <= term <= MAX_TERM:
        return f"term must be an integer in [0, {MAX_TERM}], got {term!r}"
    if voted_for is not None and (type(voted_for) is not bytes or len(voted_for) != PEER_ID_BYTES):
        return f"voted_for must be None or a {PEER_ID_BYTES}-byte peer id, got {voted_for!r:.80}"
    return None


def _check(term: object, voted_for: object) -> None:
    problem = persist_problem(term, voted_for)
    if problem is not None:
        raise ValueError(problem)


class MemoryElectionStore:
    """Term and vote in memory; survives a simulated restart when the simulation keeps it."""

    def __init__(self) -> None:
        self.term = 0
        self.voted_for: bytes | None = None
        self.writes = 0

    def load(self) -> tuple[int, bytes | None]:
        return self.term, self.voted_for

    def persist(self, term: int, voted_for: bytes | None) -> None:
        _check(term, voted_for)
        self.term, self.voted_for = term, voted_for
        self.writes += 1


class FileElectionStore:
    """Term and vote in DATA_DIR/election.json, written with fsync and an atomic rename."""

    def __init__(self, data_dir: str | os.PathLike) -> None:
        self.dir = Path(data_dir)
        self.path = self.dir / ELECTION_FILE

    def load(self) -> tuple[int, bytes | None]:
        """(0, None) when no file exists yet; ElectionStoreError when it cannot be read."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return 0, None
        except OSError as e:
            raise ElectionStoreError(f"cannot read {self.path}: {e.strerror}") from None
        try:
            if len(data) > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            obj = json.loads(data)
            if type(obj) is not dict or set(obj) != {"version", "term", "voted_for"}:
                raise ValueError("expected the keys version, term, voted_for")
            if obj["version"] != FORMAT_VERSION:
                raise ValueError(f"format {obj['version']!r}, this version reads {FORMAT_VERSION}")
            vote = obj["voted_for"]
            voted_for = None if vote is None else bytes.fromhex(vote) if type(vote) is str else vote
            _check(obj["term"], voted_for)
        except (ValueError, TypeError) as e:
            raise ElectionStoreError(f"{self.path} is damaged ({e}): this peer cannot know whether it already voted; "
                                     f"move the file away only if no peer of the swarm is running a term "
                                     f"it may have voted in") from None
        return obj["term"], voted_for

    def persist(self, term: int, voted_for: bytes | None) -> None:
        _check(term, voted_for)
        body = json.dumps({"version": FORMAT_VERSION, "term": term,
                           "voted_for": None if voted_for is None else voted_for.hex()}).encode()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, body, mode=0o600, sync_dir=True)
        except OSError as e:
            raise ElectionStoreError(f"cannot write {self.path}: {e.strerror}") from None


ElectionStore = FileElectionStore | MemoryElectionStore
