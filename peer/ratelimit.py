"""Per-source rate limits for what peers may ask of the daemon (address lists, address
confirmations): one token bucket per source (`dtfm.net.TokenBuckets`), the sources themselves
bounded.

Sans-IO: `allow(source, now)` decides; nothing sleeps. A source not seen for a while is
forgotten first when the table is full; a forgotten source starts again with a full bucket,
which costs at most `burst` extra requests, and only for one of `max_sources` sources.
"""

from __future__ import annotations

import math

from dtfm.net import TokenBuckets


class SourceRate(TokenBuckets[bytes]):
    def __init__(self, rate_per_s: float, burst: int, *, max_sources: int = 4096) -> None:
        if not (math.isfinite(rate_per_s) and rate_per_s > 0):
            raise ValueError("rate_per_s must be a positive number")
        if burst < 1 or max_sources < 1:
            raise ValueError("burst and max_sources must be positive")
        super().__init__(rate_per_s, burst, max_sources)
        self.max_sources = max_sources
