"""`HelloGuard`: freshness of handshake hellos (sans-IO).

A hello carries the initiator's wall-clock time under the swarm-key MAC. The responder refuses
a hello whose time is more than `skew_s` from its own clock, and one whose MAC it has seen
before: every hello accepted within the window is remembered until it falls out of the window,
so a hello recorded off the wire by someone without the swarm key cannot be played again.

The record is bounded (`max_entries`). When it is full the entry with the oldest timestamp is
forgotten and `floor` rises to that timestamp: hellos at or below the floor are refused as if
replayed, so forgetting never lets a replay through; under a flood of fresh hellos the
effective window just shrinks.
"""

from __future__ import annotations

import heapq
import math

__all__ = ["HelloGuard"]


class HelloGuard:
    def __init__(self, skew_s: float, max_entries: int = 16384) -> None:
        if not skew_s > 0 or max_entries < 1:
            raise ValueError("skew_s > 0 and max_entries >= 1 required")
        self.skew_s = skew_s
        self.max_entries = max_entries
        self.floor = -math.inf
        self._seen: set[bytes] = set()
        self._by_time: list[tuple[float, bytes]] = []  # heap of (sent_s, mac) for every entry of _seen

    def check(self, mac: bytes, sent_s: float, now_s: float) -> str | None:
        """None when the hello is fresh (and remember it), else why it is refused."""
        self._expire(now_s)
        if sent_s < now_s - self.skew_s:
            return f"hello sent {now_s - sent_s:.0f} s ago by our clock (window {self.skew_s:g} s)"
        if sent_s > now_s + self.skew_s:
            return f"hello sent {sent_s - now_s:.0f} s in the future by our clock (window {self.skew_s:g} s)"
        if mac in self._seen:
            return "replayed hello"
        if sent_s <= self.floor:
            return "hello older than the replay record reaches"
        if len(self._seen) >= self.max_entries:
            if sent_s <= self._by_time[0][0]:  # forgetting the oldest would raise the floor past it
                return "hello older than the replay record reaches"
            oldest, old_mac = heapq.heappop(self._by_time)
            self._seen.discard(old_mac)
            self.floor = max(self.floor, oldest)
        self._seen.add(mac)
        heapq.heappush(self._by_time, (sent_s, mac))
        return None

    def _expire(self, now_s: float) -> None:
        # Entries that left the window: a replay of them fails the window check instead.
        while self._by_time and self._by_time[0][0] < now_s - self.skew_s:
            _, mac = heapq.heappop(self._by_time)
            self._seen.discard(mac)

    def __len__(self) -> int:
        return len(self._seen)
