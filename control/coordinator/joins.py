"""Joined peers taken in as a wave: one reconfiguration for many joins, not one per join.

Every reconfiguration stops the run at a step boundary and starts the next epoch, so a swarm
that grows from 8 peers to 64 one join at a time would stop 56 times. The coordinator notes
each ready joiner (a live peer outside the run whose links are measured) when it first sees it,
and takes the wave in once it has settled: no new joiner for `settle_s`, or the first of the
wave waiting `max_wait_s` (a steady trickle of joins still gets in). A joiner that goes away
before then leaves the wave; any reconfiguration takes every live peer into account, so it ends
the wave too.

A wave is planned before anything stops (watch.py): when the scheduler keeps the run as it is
(it is not faster with the joiners), the joiners are `decline`d: they wait outside the run,
asked nothing and taken in by no wave while they stay live (the drift check's scheduler still
counts them, and any reconfiguration places them or names them spares).

    wave = JoinWave(settle_s=10.0, max_wait_s=60.0)
    if wave.due(ready, now):
        wave.clear()
        ... reconfigure ...
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["JoinWave"]


class JoinWave:
    def __init__(self, settle_s: float, max_wait_s: float) -> None:
        if not 0 <= settle_s <= max_wait_s:
            raise ValueError("need 0 <= settle_s <= max_wait_s")
        self.settle_s = settle_s
        self.max_wait_s = max_wait_s
        self._seen: dict[bytes, float] = {}  # ready joiner -> when it was first seen ready
        self._last_new = -math.inf
        self._declined: set[bytes] = set()  # joiners the scheduler kept out, while they stay live

    def __len__(self) -> int:
        return len(self._seen)

    def due(self, ready: Iterable[bytes], now: float) -> bool:
        """Note the ready joiners seen at `now`; whether the wave is to be taken in now."""
        ready = set(ready) - self._declined
        for p in [p for p in self._seen if p not in ready]:
            del self._seen[p]
        for p in ready - self._seen.keys():
            self._seen[p] = now
            self._last_new = now
        if not self._seen:
            return False
        return now - self._last_new >= self.settle_s or now - min(self._seen.values()) >= self.max_wait_s

    def wait_s(self, now: float) -> float:
        """Seconds until the wave is due unless another joiner arrives (inf: no wave)."""
        if not self._seen:
            return math.inf
        return max(0.0, min(self._last_new + self.settle_s, min(self._seen.values()) + self.max_wait_s) - now)

    def clear(self) -> None:
        """A reconfiguration took every live peer into account: no wave, nobody declined."""
        self._seen.clear()
        self._last_new = -math.inf
        self._declined.clear()

    def decline(self, peers: Iterable[bytes]) -> None:
        """The scheduler keeps the run as it is with `peers`: they leave the wave and join no
        other while they stay live (`prune`)."""
        for p in peers:
            self._seen.pop(p, None)
            self._declined.add(p)
        if not self._seen:
            self._last_new = -math.inf

    @property
    def declined(self) -> frozenset[bytes]:
        return frozenset(self._declined)

    def prune(self, live: Iterable[bytes]) -> None:
        """Forget the declined joiners no longer live: one that comes back is a new joiner."""
        self._declined &= set(live)
