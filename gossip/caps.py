"""How many confirmed members each address group holds, against a cap per group.

Admission (`admission.py`) bounds how fast members come in from an address; it does not bound
how many: one process answering pings on 150 ports made 132 confirmed members in half a minute
(security review 2026-11-28, N5). So confirmed members are also counted per address group of
the address they were confirmed at (`member_groups`: an IPv4 address; an IPv6 /64 and its /48;
every loopback address together), and a group holds at most its cap (`GossipConfig`'s
`max_members_per_address`, `max_members_per_ipv6_48`, `max_members_per_loopback`). The
address is the one a verification ping reached the member at, so a fake claiming someone
else's address cannot spend that address's places: only members that answered there count.

A member counts in the groups of the address it was confirmed at for as long as it stays in
the table (a confirmed member's later address is not checked again, so it cannot leave its
group by claiming another); the caps bound the live ones, neither dead nor left. Ourselves:
never counted.

Pure bookkeeping; `membership.py` decides what to refuse and whom to evict.
"""

from __future__ import annotations

from collections.abc import Callable

from .admission import GroupKind, member_groups
from .config import GossipConfig

__all__ = ["Arrivals", "GroupCaps"]


class GroupCaps:
    def __init__(self, config: GossipConfig) -> None:
        self._cap = {GroupKind.ADDRESS: config.max_members_per_address,
                     GroupKind.IPV6_48: config.max_members_per_ipv6_48,
                     GroupKind.LOOPBACK: config.max_members_per_loopback}
        self._members: dict[str, dict[bytes, None]] = {}  # group -> its members, in order counted
        self._groups: dict[bytes, tuple[tuple[str, GroupKind], ...]] = {}  # member -> its groups

    def cap(self, kind: GroupKind) -> int:
        return self._cap[kind]

    def add(self, peer_id: bytes, host: str) -> None:
        """Count peer_id in the groups of host (the address it was confirmed at)."""
        self.remove(peer_id)
        groups = member_groups(host)
        self._groups[peer_id] = groups
        for g, _ in groups:
            self._members.setdefault(g, {})[peer_id] = None

    def remove(self, peer_id: bytes) -> None:
        for g, _ in self._groups.pop(peer_id, ()):
            members = self._members[g]
            del members[peer_id]
            if not members:
                del self._members[g]

    def groups_of(self, peer_id: bytes) -> tuple[tuple[str, GroupKind], ...]:
        return self._groups.get(peer_id, ())

    def count(self, group: str, live: Callable[[bytes], bool] | None = None) -> int:
        """Members counted in group (only those `live` names, if given)."""
        members = self._members.get(group, {})
        return len(members) if live is None else sum(1 for p in members if live(p))

    def full(self, host: str, live: Callable[[bytes], bool] | None = None) -> tuple[str, GroupKind] | None:
        """The first group of host that holds its cap of members (`live` ones, if given), or
        None: a member at host may be counted."""
        for g, kind in member_groups(host):
            if self.count(g, live) >= self._cap[kind]:
                return g, kind
        return None

    def largest(self, host: str) -> int:
        """Members counted in host's most populous group."""
        return max(self.count(g) for g, _ in member_groups(host))

    def fullest(self, evictable: Callable[[bytes], bool]) -> tuple[int, bytes] | None:
        """(count, member) of the most populous group holding an evictable member, and of it the
        member counted last; None if no counted member is evictable."""
        best: tuple[int, bytes] | None = None
        for members in self._members.values():
            if best is not None and len(members) <= best[0]:
                continue
            victim = next((p for p in reversed(members) if evictable(p)), None)
            if victim is not None:
                best = (len(members), victim)
        return best


class Arrivals:
    """Unconfirmed members by the address group their claim came in from (None: not known),
    to find the most over-represented one when the table is full."""

    def __init__(self) -> None:
        self._members: dict[str | None, dict[bytes, None]] = {}  # group -> members, oldest first
        self._group: dict[bytes, str | None] = {}

    def add(self, peer_id: bytes, group: str | None) -> None:
        if peer_id in self._group:
            return  # counted where it first came in from
        self._group[peer_id] = group
        self._members.setdefault(group, {})[peer_id] = None

    def remove(self, peer_id: bytes) -> None:
        if peer_id not in self._group:
            return
        group = self._group.pop(peer_id)
        members = self._members[group]
        del members[peer_id]
        if not members:
            del self._members[group]

    def count(self, group: str | None) -> int:
        return len(self._members.get(group, ()))

    def oldest_of_largest(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """The longest-held evictable member of the group with the most members (ties: the group
        seen first); None if none is evictable."""
        for members in sorted(self._members.values(), key=len, reverse=True):
            victim = next((p for p in members if evictable(p)), None)
            if victim is not None:
                return victim
        return None
