"""Per-source rate limits for what peers may ask of the daemon (address lists, address
confirmations): one token bucket per source, the sources themselves bounded.

Sans-IO: `allow(source, now)` decides; nothing sleeps. A source not seen for a while is
forgotten first when the table is full; a forgotten source starts again with a full bucket,
which costs at most `burst` extra requests, and only for one of `max_sources` sources.
"""

from __future__ import annotations

import math
from collections import OrderedDict


class SourceRate:
    def __init__(self, rate_per_s: float, burst: int, *, max_sources: int = 4096):
        if not (math.isfinite(rate_per_s) and rate_per_s > 0):
            raise ValueError("rate_per_s must be a positive number")
        if burst < 1 or max_sources < 1:
            raise ValueError("burst and max_sources must be positive")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_sources = max_sources
        self._buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # tokens, at

    def allow(self, source: bytes, now: float) -> bool:
        """True (and one token spent) if `source` is within its rate at time `now`."""
        tokens, at = self._buckets.pop(source, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - at) * self.rate_per_s)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        self._buckets[source] = (tokens, now)
        while len(self._buckets) > self.max_sources:
            self._buckets.popitem(last=False)
        return allowed

    def __len__(self) -> int:
        return len(self._buckets)
