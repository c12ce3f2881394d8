"""Queue of membership updates to piggyback, each retransmitted a bounded number of times
(memberlist's TransmitLimitedQueue): fewest-sent first, a newer update about a peer replaces
the older one."""

from __future__ import annotations

from .members import Update

__all__ = ["BroadcastQueue"]

# Bytes one packed member entry takes beyond its host and region strings.
_ENTRY_OVERHEAD = 56
_MIN_SIZE = _ENTRY_OVERHEAD + 34


def entry_size(u: Update) -> int:
    return _ENTRY_OVERHEAD + 34 + len(u.member.host) + len(u.member.region)


class BroadcastQueue:
    def __init__(self) -> None:
        # transmissions so far -> {peer id: update}, oldest first (dicts keep insertion order)
        self._buckets: dict[int, dict[bytes, Update]] = {}
        self._sent: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def queue(self, m: Update) -> None:
        pid = m.member.peer_id
        old = self._sent.pop(pid, None)
        if old is not None:
            del self._buckets[old][pid]
        self._buckets.setdefault(0, {})[pid] = m
        self._sent[pid] = 0

    def take(self, budget_bytes: int, limit: int) -> list[Update]:
        """Updates fitting in budget_bytes, least transmitted (then newest) first; each taken
        one counts a transmission and is dropped once sent `limit` times."""
        out: list[Update] = []
        room = budget_bytes
        for sent in sorted(self._buckets):
            if room < _MIN_SIZE:
                break
            for pid, m in reversed(self._buckets[sent].items()):
                size = entry_size(m)
                if size <= room:
                    out.append(m)
                    room -= size
                if room < _MIN_SIZE:
                    break
        for m in out:
            pid = m.member.peer_id
            sent = self._sent.pop(pid)
            del self._buckets[sent][pid]
            if not self._buckets[sent]:
                del self._buckets[sent]
            if sent + 1 < limit:
                self._buckets.setdefault(sent + 1, {})[pid] = m
                self._sent[pid] = sent + 1
        return out

    def pending(self) -> list[Update]:
        return [m for bucket in self._buckets.values() for m in bucket.values()]
