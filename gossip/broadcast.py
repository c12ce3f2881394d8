"""Queue of membership updates to piggyback, each retransmitted a bounded number of times
(memberlist's TransmitLimitedQueue): fewest-sent first, a newer update about a peer replaces
the older one."""

from __future__ import annotations

import heapq

from .members import Update

__all__ = ["BroadcastQueue"]

# Bytes one packed member entry takes beyond its host and region strings.
_ENTRY_OVERHEAD = 56
_MIN_SIZE = _ENTRY_OVERHEAD + 34


def entry_size(u: Update) -> int:
    return _ENTRY_OVERHEAD + 34 + len(u.member.host) + len(u.member.region)


class BroadcastQueue:
    def __init__(self) -> None:
        self._items: dict[bytes, tuple[Update, int, int]] = {}  # id -> (entry, transmits, order)
        self._order = 0

    def __len__(self) -> int:
        return len(self._items)

    def queue(self, m: Update) -> None:
        self._order += 1
        self._items[m.member.peer_id] = (m, 0, self._order)

    def take(self, budget_bytes: int, limit: int) -> list[Update]:
        """Updates fitting in budget_bytes, least transmitted (then newest) first; each taken
        one counts a transmission and is dropped once sent `limit` times."""
        if not self._items:
            return []
        most = max(1, budget_bytes // _MIN_SIZE)  # no more than this many can fit
        ranked = heapq.nsmallest(most, self._items.items(), key=lambda kv: (kv[1][1], -kv[1][2]))
        out: list[Update] = []
        used = 0
        for pid, (m, sent, order) in ranked:
            size = entry_size(m)
            if used + size > budget_bytes:
                continue
            used += size
            out.append(m)
            if sent + 1 >= limit:
                del self._items[pid]
            else:
                self._items[pid] = (m, sent + 1, order)
        return out

    def pending(self) -> list[Update]:
        return [m for m, _, _ in self._items.values()]
