"""Admission control for incoming handshakes (sans-IO).

An accepted connection goes through two stages, each bounded per source host and overall:

1. pending (`arrive` ... `left`): accepted, its hello not yet complete. Costs a socket and a
   task, no cryptography; the transport closes it after a short hello timeout.
2. half-open (`admit` ... `finished`): its hello arrived; the responder checks the swarm-key
   MAC and, if it holds, spends a key exchange and a signature and waits for the third
   message. Starting one takes a token from the source's bucket (sustained rate and burst).

So a connection that sends nothing never holds a handshake slot, and one source cannot hold
more than its share of either stage. Sources are counted by host (ports are free to forge) and
an IPv6 source by its /64, the block one subscriber usually gets. The table of buckets is
bounded; the least recently seen hosts are forgotten first, which only ever makes the limiter
more lenient, never stricter. Counts per host exist only while non-zero, so they are bounded by
the stage caps.
"""

from __future__ import annotations

import ipaddress
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["HandshakeAdmission", "TokenBuckets", "source_key"]


def source_key(host: str) -> str:
    """What a source host counts as: an IPv4 address, an IPv6 /64 (IPv4-mapped IPv6 as the
    IPv4 address), or anything else (a name in tests) as given."""
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


@dataclass
class _Bucket:
    tokens: float
    updated: float
    until: float = -math.inf  # the end of a grant (`TokenBuckets.grant`)


K = TypeVar("K", bound=Hashable)


class TokenBuckets(Generic[K]):
    """A token bucket per key: `burst` tokens at most, refilled at `rate_per_s`; at most
    `max_keys` keys tracked. A key not tracked has a full bucket, so forgetting a key can only
    make the limit more lenient for it.

    Which key is forgotten when the table is full: `evict="oldest"`, the least recently used
    (O(1)); `"fullest"`, the one with the most tokens, which is the one a newcomer would start
    like (O(keys), for small tables whose every bucket must hold).

    `allow` spends a token when there is one; `tokens` and `take` read and spend apart, for a
    caller that checks several buckets before it spends from any; `touch` tracks a key without
    spending. `on_forget(key)` is called for each key the bounded table drops."""

    def __init__(self, rate_per_s: float, burst: float, max_keys: int = 4096, *, evict: str = "oldest",
                 on_forget: Callable[[K], object] | None = None) -> None:
        if not (math.isfinite(rate_per_s) and rate_per_s >= 0):
            raise ValueError("rate_per_s must be a non-negative number")
        if not (math.isfinite(burst) and burst >= 0) or max_keys < 1:
            raise ValueError("burst must be a non-negative number and max_keys at least 1")
        if evict not in ("oldest", "fullest"):
            raise ValueError(f"evict must be 'oldest' or 'fullest', not {evict!r}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_keys = max_keys
        self._fullest = evict == "fullest"
        self._on_forget = on_forget
        self._buckets: OrderedDict[K, _Bucket] = OrderedDict()

    def tokens(self, key: K, now: float) -> float:
        """The tokens `key` has at `now` (nothing changes)."""
        b = self._buckets.get(key)
        return float(self.burst) if b is None else self._level(b, now)

    def allow(self, key: K, now: float) -> bool:
        """True, and one token spent, if `key` has a token at `now`."""
        b = self._touch(key, now)
        allowed = b.tokens >= 1.0
        if allowed:
            b.tokens -= 1.0
        self._bound(now)
        return allowed

    def take(self, key: K, now: float) -> None:
        """Spend a token of `key`, or what is left of one."""
        b = self._touch(key, now)
        b.tokens = max(0.0, b.tokens - 1.0)
        self._bound(now)

    def touch(self, key: K, now: float) -> None:
        """Count `key` as seen at `now` (tracked, most recently used) without spending."""
        self._touch(key, now)
        self._bound(now)

    def grant(self, key: K, tokens: float, now: float, duration_s: float) -> None:
        """Raise `key`'s tokens to `tokens` for `duration_s`, neither capped at `burst` nor
        refilled while the grant lasts."""
        b = self._touch(key, now)
        b.tokens = max(float(tokens), b.tokens)
        b.until = now + duration_s

    def __len__(self) -> int:
        return len(self._buckets)

    def _level(self, b: _Bucket, now: float) -> float:
        if now <= b.until:
            return b.tokens
        return min(float(self.burst), b.tokens + max(0.0, now - b.updated) * self.rate_per_s)

    def _touch(self, key: K, now: float) -> _Bucket:
        """`key`'s bucket, brought up to `now` (made full if untracked)."""
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(float(self.burst), now)
        else:
            b.tokens = self._level(b, now)
            b.updated = now
            if not self._fullest:
                self._buckets.move_to_end(key)
        return b

    def _bound(self, now: float) -> None:
        """Forget one key when over `max_keys` (every call that adds a key comes here but for
        `grant`: the allowance of the peer we join through may hold a place beyond the table's)."""
        if len(self._buckets) > self.max_keys:
            if self._fullest:
                key = max(self._buckets, key=lambda k: self._level(self._buckets[k], now))
                del self._buckets[key]
            else:
                key = self._buckets.popitem(last=False)[0]
            if self._on_forget is not None:
                self._on_forget(key)


class HandshakeAdmission:
    """Pending connections and half-open handshakes, each capped overall and per source, plus
    a token bucket per source for starting handshakes."""

    def __init__(
        self,
        rate_per_s: float,
        burst: float,
        max_half_open: int,
        *,
        max_half_open_per_host: int | None = None,
        max_pending: int = 256,
        max_pending_per_host: int = 16,
        max_tracked: int = 4096,
    ) -> None:
        per_host = max_half_open if max_half_open_per_host is None else max_half_open_per_host
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s > 0 and burst >= 1 required")
        if min(max_half_open, per_host, max_pending, max_pending_per_host) < 1:
            raise ValueError("every cap must be >= 1")
        self._buckets: TokenBuckets[str] = TokenBuckets(rate_per_s, burst, max_tracked)
        self.max_half_open = max_half_open
        self.max_half_open_per_host = per_host
        self.max_pending = max_pending
        self.max_pending_per_host = max_pending_per_host
        self._half_open: Counter[str] = Counter()
        self._pending: Counter[str] = Counter()
        self.half_open = 0
        self.pending = 0

    def arrive(self, host: str) -> str | None:
        """None if a newly accepted connection from `host` may wait for its hello (it then
        counts as pending until `left`), else the reason to close it."""
        key = source_key(host)
        if self.pending >= self.max_pending:
            return f"too many connections awaiting their hello ({self.pending})"
        if self._pending[key] >= self.max_pending_per_host:
            return f"too many connections from {key} awaiting their hello"
        self._pending[key] += 1
        self.pending += 1
        return None

    def left(self, host: str) -> None:
        """A pending connection delivered its hello, timed out or went away."""
        _decrement(self._pending, source_key(host))
        self.pending = max(0, self.pending - 1)

    def admit(self, host: str, now: float) -> str | None:
        """None if the hello from `host` may start a handshake (it then counts as half-open
        until `finished`), else the reason to close it."""
        key = source_key(host)
        if self.half_open >= self.max_half_open:
            return f"too many handshakes in progress ({self.half_open})"
        if self._half_open[key] >= self.max_half_open_per_host:
            return f"too many handshakes in progress from {key}"
        if not self._buckets.allow(key, now):
            return f"handshake rate limit for {key}"
        self._half_open[key] += 1
        self.half_open += 1
        return None

    def finished(self, host: str) -> None:
        """A handshake admitted earlier completed or failed."""
        _decrement(self._half_open, source_key(host))
        self.half_open = max(0, self.half_open - 1)


def _decrement(counts: Counter[str], key: str) -> None:
    if counts[key] <= 1:
        del counts[key]
    else:
        counts[key] -= 1
