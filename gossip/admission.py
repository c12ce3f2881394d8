"""How fast members may enter our table: token buckets per source identity and per remote
address.

Anyone holding the swarm key can make identities and sign claims for them, so signatures
alone do not stop one member from flooding the table with fake members (each then probed at
an address of the attacker's choosing), and a limit per identity alone stops nothing: a fresh
identity costs nothing. So every new member costs a token twice:

- of the *source* (the authenticated peer that sent the claim), when the source introduces a
  member other than itself;
- of the source's *remote address* (`address_group`: the IPv4 address, or the /64 of an IPv6
  address; every loopback address is one group), always, a member's claim about itself
  included.

This bounds a rate; `caps.py` bounds how many confirmed members an address group holds.

Buckets hold a burst and refill at a fixed rate. The peer we join through gets one allowance
of a whole table, once, for its identity and its address: it is the one source we chose, and
it must hand us the swarm; the allowance lapses after a while.
"""

from __future__ import annotations

import enum
import ipaddress
import socket
from collections.abc import Hashable

from dtfm.net import TokenBuckets

__all__ = ["GroupKind", "LOOPBACK_GROUP", "address_group", "admission_buckets", "member_groups"]


class GroupKind(enum.Enum):
    """Which cap of confirmed members an address group has (`caps.py`)."""

    ADDRESS = "address"  # an IPv4 address, an IPv6 /64, a name that is no IP address
    IPV6_48 = "ipv6/48"  # an IPv6 /48: one site, 65,536 /64s
    LOOPBACK = "loopback"  # every loopback address (127.0.0.0/8, ::1): this host


LOOPBACK_GROUP = "loopback"


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address a host string spells, in any form a dial would take it: canonical, with a
    link-local zone (the same host), or the legacy IPv4 forms `inet_aton` reads (127.1,
    0x7f000001, 0177.0.0.1); None for a name."""
    h = host.split("%", 1)[0]
    try:
        return ipaddress.ip_address(h)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(h))
    except (OSError, ValueError):
        return None


def member_groups(host: str) -> tuple[tuple[str, GroupKind], ...]:
    """The address groups a host counts in, finest first: an IPv4 address; an IPv6 address's
    /64 and /48 networks; every loopback address is one group, this host (127.0.0.2, 127.1,
    ::1 and `localhost` are no other party than 127.0.0.1); an IPv4-mapped IPv6 address is its
    IPv4 address. A name that is no IP address (an in-memory test network's) is its own group,
    lower case, without a trailing dot."""
    ip = _ip(host)
    if ip is None:
        name = host.lower().rstrip(".")
        if name == "localhost" or name.endswith(".localhost"):
            return ((LOOPBACK_GROUP, GroupKind.LOOPBACK),)
        return ((name, GroupKind.ADDRESS),)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return ((LOOPBACK_GROUP, GroupKind.LOOPBACK),)
    if isinstance(ip, ipaddress.IPv6Address):
        return ((str(ipaddress.IPv6Network((ip, 64), strict=False)), GroupKind.ADDRESS),
                (str(ipaddress.IPv6Network((ip, 48), strict=False)), GroupKind.IPV6_48))
    return ((str(ip), GroupKind.ADDRESS),)


def address_group(host: str) -> str:
    """The unit one party is assumed to hold at most one of (`member_groups`' finest): an IPv4
    address; the /64 network of an IPv6 address (one subnet: a host gets a whole /64); an
    IPv4-mapped IPv6 address is its IPv4 address; every loopback address is `LOOPBACK_GROUP`.
    A name that is no IP address (an in-memory test network's) is itself."""
    return member_groups(host)[0][0]


def admission_buckets(rate_per_s: float, burst: int, max_sources: int) -> TokenBuckets[Hashable]:
    """Tokens per key (a source's peer id, or an address group): `burst` at most, `rate_per_s`
    refill; at most `max_sources` tracked (the fullest bucket is forgotten first: it is the one
    a newcomer would start with). A member costs a token only once it is taken in: check with
    `tokens(key, now) >= 1`, spend with `take`; `grant` is the allowance of the peer we join
    through."""
    return TokenBuckets(rate_per_s, burst, max_sources, evict="fullest")
