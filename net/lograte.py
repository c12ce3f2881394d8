"""Rate-limited log lines (sans-IO): what a flood of bad input may not turn into a flood of log.

`LogLimiter.admit(key, now)` decides whether a line about `key` (a source host) goes out: at most
one per key every `interval_s`, and at most `burst` lines overall in any `interval_s` (a flood
from many hosts). The lines left out are counted per key, and the next line about that key says
how many there were. The table of keys is bounded; the least recently seen are forgotten first
(their counts with them).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["LogLimiter"]


class LogLimiter:
    def __init__(self, interval_s: float, *, burst: int = 10, max_keys: int = 1024):
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError("interval_s must be a positive number")
        if burst < 1 or max_keys < 1:
            raise ValueError("burst and max_keys must be positive")
        self.interval_s = interval_s
        self.burst = burst
        self.max_keys = max_keys
        self._keys: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()  # last logged at, left out
        self._tokens = float(burst)
        self._tokens_at: float | None = None

    def admit(self, key: Hashable, now: float) -> int | None:
        """None: leave this line out (it is counted). Otherwise log it; the number is how many
        lines about `key` were left out since the last one logged."""
        last, left_out = self._keys.pop(key, (-math.inf, 0))
        allowed = now - last >= self.interval_s and self._take_token(now)
        if allowed:
            self._keys[key] = (now, 0)
        else:
            self._keys[key] = (last, left_out + 1)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        return left_out if allowed else None

    def __len__(self) -> int:
        """How many keys the table holds now."""
        return len(self._keys)

    def _take_token(self, now: float) -> bool:
        if self._tokens_at is not None:
            self._tokens = min(float(self.burst),
                               self._tokens + max(0.0, now - self._tokens_at) * self.burst / self.interval_s)
        self._tokens_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True
