"""Suspicion timeouts with Lifeguard's independent confirmations (memberlist suspicion.go)."""

from __future__ import annotations

import math

__all__ = ["remaining_suspicion_time", "Suspicion"]


def remaining_suspicion_time(n: int, k: int, elapsed_s: float, min_s: float, max_s: float) -> float:
    """Seconds left of a suspicion with n of k expected confirmations after elapsed_s.

    Starts at max_s and falls logarithmically to min_s as confirmations arrive (memberlist's
    remainingSuspicionTime).
    """
    if k < 1:
        timeout = min_s
    else:
        frac = math.log(n + 1.0) / math.log(k + 1.0)
        raw = max_s - frac * (max_s - min_s)
        timeout = max(math.floor(1000.0 * raw) / 1000.0, min_s)
    return timeout - elapsed_s


class Suspicion:
    """One suspicion of one peer at one incarnation; counts distinct confirmers."""

    __slots__ = ("k", "min_s", "max_s", "start", "confirmers", "deadline")

    def __init__(self, suspector: bytes, k: int, min_s: float, max_s: float, now: float) -> None:
        self.k = k
        self.min_s = min_s
        self.max_s = max_s
        self.start = now
        self.confirmers = {suspector}
        self.deadline = now + remaining_suspicion_time(0, k, 0.0, min_s, max_s)

    def confirm(self, from_peer: bytes, now: float) -> bool:
        """Count an independent confirmation; True if it was new (and shortened the timeout)."""
        if len(self.confirmers) - 1 >= self.k or from_peer in self.confirmers:
            return False
        self.confirmers.add(from_peer)
        n = len(self.confirmers) - 1
        self.deadline = self.start + remaining_suspicion_time(n, self.k, 0.0, self.min_s, self.max_s)
        return True
