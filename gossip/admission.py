"""How fast one source may add members to our table: a token bucket per source.

Anyone holding the swarm key can make identities and sign claims for them, so signatures
alone do not stop one member from flooding the table with fake members (each then probed at
an address of the attacker's choosing). A member introducing itself is always admitted; the
members a source introduces on behalf of others cost a token each, refilled at a fixed rate
up to a burst. The peer we join through gets one allowance of a whole table, once: it is the
one source we chose, and it must hand us the swarm; the allowance lapses after a while.
"""

from __future__ import annotations

__all__ = ["AdmissionLimiter"]


class AdmissionLimiter:
    """Tokens per source: `burst` at most, `rate_per_s` refill; at most `max_sources` tracked
    (the fullest bucket is forgotten first: it is the one a newcomer would start with)."""

    def __init__(self, rate_per_s: float, burst: int, max_sources: int = 4096) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_sources = max_sources
        # source -> (tokens, as of, end of a grant)
        self._buckets: dict[bytes, tuple[float, float, float]] = {}

    def tokens(self, source: bytes, now: float) -> float:
        tokens, at, until = self._buckets.get(source, (float(self.burst), now, float("-inf")))
        if now <= until:
            return tokens  # a grant: neither capped nor refilled while it lasts
        return min(float(self.burst), tokens + (now - at) * self.rate_per_s)

    def allow(self, source: bytes, now: float) -> bool:
        """Whether source has a token left (does not take it)."""
        return self.tokens(source, now) >= 1.0

    def take(self, source: bytes, now: float) -> None:
        tokens = self.tokens(source, now)
        until = self._buckets.get(source, (0.0, 0.0, float("-inf")))[2]
        self._buckets[source] = (max(0.0, tokens - 1.0), now, until)
        if len(self._buckets) > self.max_sources:
            fullest = max(self._buckets, key=lambda s: self.tokens(s, now))
            del self._buckets[fullest]

    def grant(self, source: bytes, tokens: int, now: float, duration_s: float) -> None:
        """Raise source's allowance to `tokens` for duration_s (the peer we join through)."""
        self._buckets[source] = (max(float(tokens), self.tokens(source, now)), now, now + duration_s)
