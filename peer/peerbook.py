"""The daemon's book of known peers: who is connected, whom to dial next, who left.

Sans-IO: every method takes `now` (seconds, trio time) and returns decisions; the daemon does
the dialling. Addresses learnt from other peers are dialled once, redialled with exponential
backoff after failures, and forgotten after `forget_after_failures` failed dials in a row.
A peer that said it is leaving is not redialled until it connects to us again.

Bounded against members that lie: an address heard from another peer is *unverified* until a
connection to it completes a handshake. At most `max_entries` entries are kept from what peers
tell us, and at most `max_per_source` unverified ones from any one peer; a new address that
does not fit replaces the oldest unverified entry (of that peer when it is over its share,
else of anyone) that is not being dialled, or is refused. `due(now, limit)` hands out at most
`limit` dials, so the book is also the bounded queue of dials waiting for a free slot.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from dataclasses import dataclass

from dtfm.net import Address


def backoff_delay_s(failures: int, initial_s: float, max_s: float, rng: random.Random) -> float:
    """Delay before retry number `failures` (1, 2, ...): doubling from initial_s, capped at
    max_s, times a random factor in [0.5, 1) so peers that failed together do not retry in step."""
    if failures <= 0:
        return 0.0
    base = min(max_s, initial_s * 2.0 ** min(failures - 1, 60))
    return base * (0.5 + 0.5 * rng.random())


@dataclass
class PeerEntry:
    peer_id: bytes
    address: Address
    region: str = ""
    connected: bool = False
    connected_since: float | None = None
    dialling: bool = False
    failures: int = 0
    next_dial_at: float = 0.0
    source: bytes | None = None   # the peer that told us this address (None: it connected)
    verified: bool = False        # a handshake at this peer's address completed once


@dataclass(frozen=True)
class Departure:
    peer_id: bytes
    address: Address
    region: str
    at: float
    reason: str


class PeerBook:
    def __init__(self, self_id: bytes, *, retry_initial_s: float, retry_max_s: float,
                 forget_after_failures: int = 8, departed_keep: int = 32,
                 max_entries: int = 1024, max_per_source: int = 128,
                 rng: random.Random | None = None):
        if not 1 <= max_per_source <= max_entries:
            raise ValueError("need 1 <= max_per_source <= max_entries")
        self.self_id = self_id
        self.max_entries = max_entries
        self.max_per_source = max_per_source
        self._unverified_from: Counter[bytes] = Counter()
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.forget_after_failures = forget_after_failures
        self.departed_keep = departed_keep
        self.rng = random.Random() if rng is None else rng
        self.entries: dict[bytes, PeerEntry] = {}
        self.departed: OrderedDict[bytes, Departure] = OrderedDict()

    # ---- events ------------------------------------------------------------------------------

    def learn(self, peer_id: bytes, address: Address, region: str, now: float, *,
              source: bytes | None = None) -> bool:
        """A peer's address heard from `source`; True if it is new and will be dialled. False
        also when the book is full of entries that may not be replaced."""
        if peer_id == self.self_id or peer_id in self.departed or address.port == 0:
            return False
        entry = self.entries.get(peer_id)
        if entry is None:
            if not self._make_room(source):
                return False
            self._add(PeerEntry(peer_id, address, region, next_dial_at=now, source=source))
            return True
        if not entry.connected and not entry.dialling and entry.address != address:
            entry.address = address  # a fresher address for a peer we cannot reach
            entry.region = region or entry.region
        return False

    def connected(self, peer_id: bytes, address: Address, region: str, now: float) -> None:
        self.departed.pop(peer_id, None)
        entry = self.entries.get(peer_id)
        if entry is None:
            # A connected peer always has an entry (the transport bounds connections); it
            # takes the place of an unverified one when the book is full.
            if len(self.entries) >= self.max_entries:
                self._evict_oldest_unverified(None)
            entry = self._add(PeerEntry(peer_id, address, region))
        self._verify(entry)
        entry.address = address
        entry.region = region
        entry.connected = True
        entry.connected_since = now
        entry.dialling = False
        entry.failures = 0

    def disconnected(self, peer_id: bytes, now: float) -> None:
        """A connection dropped without a goodbye: redial after a backoff."""
        entry = self.entries.get(peer_id)
        if entry is None or not entry.connected:
            return
        entry.connected = False
        entry.connected_since = None
        entry.failures = 1
        entry.next_dial_at = now + backoff_delay_s(1, self.retry_initial_s, self.retry_max_s,
                                                   self.rng)

    def left(self, peer_id: bytes, now: float, reason: str) -> Departure | None:
        """The peer said goodbye: forget it and remember the departure for `status`."""
        entry = self._remove(peer_id)
        if entry is None:
            return None
        departure = Departure(peer_id, entry.address, entry.region, now, reason)
        self.departed[peer_id] = departure
        while len(self.departed) > self.departed_keep:
            self.departed.popitem(last=False)
        return departure

    def dial_failed(self, peer_id: bytes, now: float) -> bool:
        """A dial failed; returns True if the peer is now forgotten."""
        entry = self.entries.get(peer_id)
        if entry is None:
            return False
        entry.dialling = False
        if entry.connected:
            return False
        entry.failures += 1
        if entry.failures >= self.forget_after_failures:
            self._remove(peer_id)
            return True
        entry.next_dial_at = now + backoff_delay_s(entry.failures, self.retry_initial_s,
                                                   self.retry_max_s, self.rng)
        return False

    # ---- decisions ---------------------------------------------------------------------------

    def due(self, now: float, limit: int | None = None) -> list[tuple[bytes, Address]]:
        """Up to `limit` peers to dial now, longest waiting first; each is marked as being
        dialled until connected/dial_failed. The others stay due for a later call."""
        waiting = [e for e in self.entries.values()
                   if not e.connected and not e.dialling and e.next_dial_at <= now]
        if limit is not None:
            waiting = sorted(waiting, key=lambda e: e.next_dial_at)[:max(0, limit)]
        for entry in waiting:
            entry.dialling = True
        return [(e.peer_id, e.address) for e in waiting]

    def dialling_count(self) -> int:
        return sum(1 for e in self.entries.values() if e.dialling)

    def unverified_from(self, source: bytes) -> int:
        """How many unverified addresses `source` told us that the book still holds."""
        return self._unverified_from[source]

    def next_due_at(self) -> float | None:
        times = [e.next_dial_at for e in self.entries.values()
                 if not e.connected and not e.dialling]
        return min(times) if times else None

    def connected_peers(self) -> list[PeerEntry]:
        return [e for e in self.entries.values() if e.connected]

    def sample_connected(self, n: int, exclude: bytes | None = None) -> list[PeerEntry]:
        """Up to n connected peers, chosen at random, for an address exchange."""
        pool = [e for e in self.connected_peers() if e.peer_id != exclude]
        if len(pool) <= n:
            return pool
        return self.rng.sample(pool, n)

    # ---- bounds ------------------------------------------------------------------------------

    def _add(self, entry: PeerEntry) -> PeerEntry:
        self.entries[entry.peer_id] = entry
        if not entry.verified and entry.source is not None:
            self._unverified_from[entry.source] += 1
        return entry

    def _remove(self, peer_id: bytes) -> PeerEntry | None:
        entry = self.entries.pop(peer_id, None)
        if entry is not None:
            self._uncount(entry)
        return entry

    def _verify(self, entry: PeerEntry) -> None:
        if not entry.verified:
            self._uncount(entry)
            entry.verified = True

    def _uncount(self, entry: PeerEntry) -> None:
        if entry.verified or entry.source is None:
            return
        self._unverified_from[entry.source] -= 1
        if self._unverified_from[entry.source] <= 0:
            del self._unverified_from[entry.source]

    def _make_room(self, source: bytes | None) -> bool:
        """Room for one more unverified entry from `source`: evict if needed; False if none
        may go."""
        if source is not None and self._unverified_from[source] >= self.max_per_source:
            return self._evict_oldest_unverified(source)
        if len(self.entries) >= self.max_entries:
            return self._evict_oldest_unverified(None)
        return True

    def _evict_oldest_unverified(self, source: bytes | None) -> bool:
        """Drop the oldest unverified entry not being dialled (from `source`, or from anyone
        when None); False if there is none."""
        for entry in self.entries.values():   # insertion order: oldest first
            if entry.verified or entry.dialling or entry.connected:
                continue
            if source is not None and entry.source != source:
                continue
            self._remove(entry.peer_id)
            return True
        return False
