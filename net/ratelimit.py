"""Admission control for incoming handshakes (sans-IO).

`HandshakeAdmission.admit(address, now)` decides whether a new incoming connection may start a
handshake: a token bucket per source address (host only, ports are free to forge) and a cap on
handshakes in progress. The table of buckets is bounded; the least recently seen addresses are
forgotten first, which only ever makes the limiter more lenient, never stricter.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated: float


class TokenBuckets:
    """Token bucket per key: `rate_per_s` refill, `burst` capacity, at most `max_keys` tracked."""

    def __init__(self, rate_per_s: float, burst: float, max_keys: int = 4096) -> None:
        if rate_per_s <= 0 or burst < 1 or max_keys < 1:
            raise ValueError("rate_per_s > 0, burst >= 1 and max_keys >= 1 required")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def allow(self, key: str, now: float) -> bool:
        b = self._buckets.get(key)
        if b is None:
            b = _Bucket(self.burst, now)
            self._buckets[key] = b
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            b.tokens = min(self.burst, b.tokens + (now - b.updated) * self.rate_per_s)
            b.updated = now
        if b.tokens >= 1:
            b.tokens -= 1
            return True
        return False

    def __len__(self) -> int:
        return len(self._buckets)


class HandshakeAdmission:
    """Per-address rate limit plus a cap on concurrent (half-open) handshakes."""

    def __init__(self, rate_per_s: float, burst: float, max_half_open: int, max_tracked: int = 4096) -> None:
        if max_half_open < 1:
            raise ValueError("max_half_open >= 1 required")
        self._buckets = TokenBuckets(rate_per_s, burst, max_tracked)
        self.max_half_open = max_half_open
        self.half_open = 0

    def admit(self, host: str, now: float) -> str | None:
        """None if a handshake from `host` may start (and counts as half-open), else the reason."""
        if self.half_open >= self.max_half_open:
            return f"too many handshakes in progress ({self.half_open})"
        if not self._buckets.allow(host, now):
            return f"handshake rate limit for {host}"
        self.half_open += 1
        return None

    def finished(self) -> None:
        """A handshake admitted earlier completed or failed."""
        if self.half_open > 0:
            self.half_open -= 1
