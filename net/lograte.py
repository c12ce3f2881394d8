"""Rate-limited log lines (sans-IO): what a flood of bad input may not turn into a flood of log.

`LogLimiter.admit(key, now)` decides whether a line about `key` (a source host) goes out: at most
one per key every `interval_s`, and at most `burst` lines overall in any `interval_s` (a flood
from many hosts). The lines left out are counted per key, and the next line about that key says
how many there were. The table of keys is bounded; the least recently seen are forgotten first
(their counts with them).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from .ratelimit import TokenBuckets

__all__ = ["LogLimiter"]

_OVERALL = "overall"  # the one key of the budget shared by every key


class LogLimiter:
    """Two token buckets (`TokenBuckets`): one per key of capacity one, refilled once an
    `interval_s`, and one overall of capacity `burst`, refilled `burst` times an `interval_s`."""

    def __init__(self, interval_s: float, *, burst: int = 10, max_keys: int = 1024):
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError("interval_s must be a positive number")
        if burst < 1 or max_keys < 1:
            raise ValueError("burst and max_keys must be positive")
        self.interval_s = interval_s
        self.burst = burst
        self.max_keys = max_keys
        self._left_out: dict[Hashable, int] = {}  # lines left out per key since its last one logged
        self._per_key: TokenBuckets[Hashable] = TokenBuckets(1.0 / interval_s, 1, max_keys,
                                                             on_forget=self._forget)
        self._overall: TokenBuckets[str] = TokenBuckets(burst / interval_s, burst, 1)

    def admit(self, key: Hashable, now: float) -> int | None:
        """None: leave this line out (it is counted). Otherwise log it; the number is how many
        lines about `key` were left out since the last one logged."""
        allowed = self._per_key.tokens(key, now) >= 1.0 and self._overall.allow(_OVERALL, now)
        if allowed:
            self._per_key.take(key, now)
            return self._left_out.pop(key, 0)
        self._per_key.touch(key, now)
        self._left_out[key] = self._left_out.get(key, 0) + 1
        return None

    def __len__(self) -> int:
        """How many keys the table holds now."""
        return len(self._per_key)

    def _forget(self, key: Hashable) -> None:
        self._left_out.pop(key, None)
