"""Queue of membership updates to piggyback, each retransmitted a bounded number of times
(memberlist's TransmitLimitedQueue): fewest-sent first, a newer update replaces the older one
of its kind about the same peer (a claim replaces a claim, an accusation an accusation)."""

from __future__ import annotations

from .claims import Claim, Update

__all__ = ["BroadcastQueue"]

_MIN_SIZE = 120  # the smallest update: a claim with empty host and region


def _key(u: Update) -> tuple[bool, bytes]:
    return (isinstance(u, Claim), u.subject)


class BroadcastQueue:
    def __init__(self) -> None:
        # transmissions so far -> {(is claim, peer id): update}, oldest first (dicts keep insertion order)
        self._buckets: dict[int, dict[tuple, Update]] = {}
        self._sent: dict[tuple, int] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def queue(self, m: Update) -> None:
        pid = _key(m)
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
                size = m.wire_size
                if size <= room:
                    out.append(m)
                    room -= size
                if room < _MIN_SIZE:
                    break
        for m in out:
            pid = _key(m)
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
