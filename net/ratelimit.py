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
from collections import Counter, OrderedDict
from dataclasses import dataclass

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
        if min(max_half_open, per_host, max_pending, max_pending_per_host) < 1:
            raise ValueError("every cap must be >= 1")
        self._buckets = TokenBuckets(rate_per_s, burst, max_tracked)
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
