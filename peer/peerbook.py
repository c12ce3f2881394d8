"""The daemon's book of known peers: who is connected, whom to dial next, who left.

Sans-IO: every method takes `now` (seconds, trio time) and returns decisions; the daemon does
the dialling. Addresses learnt from other peers are dialled once, redialled with exponential
backoff after failures, and forgotten after `forget_after_failures` failed dials in a row.
A peer that said it is leaving is not redialled until it connects to us again.
"""

from __future__ import annotations

import random
from collections import OrderedDict
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
                 rng: random.Random | None = None):
        self.self_id = self_id
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.forget_after_failures = forget_after_failures
        self.departed_keep = departed_keep
        self.rng = random.Random() if rng is None else rng
        self.entries: dict[bytes, PeerEntry] = {}
        self.departed: OrderedDict[bytes, Departure] = OrderedDict()

    # ---- events ------------------------------------------------------------------------------

    def learn(self, peer_id: bytes, address: Address, region: str, now: float) -> bool:
        """A peer's address heard from someone else; True if it is new and will be dialled."""
        if peer_id == self.self_id or peer_id in self.departed or address.port == 0:
            return False
        entry = self.entries.get(peer_id)
        if entry is None:
            self.entries[peer_id] = PeerEntry(peer_id, address, region, next_dial_at=now)
            return True
        if not entry.connected and not entry.dialling and entry.address != address:
            entry.address = address  # a fresher address for a peer we cannot reach
            entry.region = region or entry.region
        return False

    def connected(self, peer_id: bytes, address: Address, region: str, now: float) -> None:
        self.departed.pop(peer_id, None)
        entry = self.entries.get(peer_id)
        if entry is None:
            entry = self.entries[peer_id] = PeerEntry(peer_id, address, region)
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
        entry = self.entries.pop(peer_id, None)
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
            del self.entries[peer_id]
            return True
        entry.next_dial_at = now + backoff_delay_s(entry.failures, self.retry_initial_s,
                                                   self.retry_max_s, self.rng)
        return False

    # ---- decisions ---------------------------------------------------------------------------

    def due(self, now: float) -> list[tuple[bytes, Address]]:
        """Peers to dial now; each is marked as being dialled until connected/dial_failed."""
        out = []
        for entry in self.entries.values():
            if not entry.connected and not entry.dialling and entry.next_dial_at <= now:
                entry.dialling = True
                out.append((entry.peer_id, entry.address))
        return out

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
