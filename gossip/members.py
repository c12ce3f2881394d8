"""Membership entries and their merge.

A member's entry is ordered by (incarnation, state rank, address, region); merging two views
keeps the larger entry per peer. That order makes the merge a join: commutative, idempotent
and monotone (an entry never goes back), and it gives SWIM's rules: at one incarnation,
suspect beats alive, dead beats suspect and left beats dead; a live peer refutes with a higher
incarnation, which beats all of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dtfm.net import PEER_ID_BYTES, ProtocolError, get_bytes, get_int, get_list, get_str

__all__ = ["MemberState", "Member", "merge_entry", "merge_tables", "MAX_INCARNATION"]

MAX_INCARNATION = 2**63 - 1
MAX_HOST_LEN = 255
MAX_REGION_LEN = 64


class MemberState(enum.IntEnum):
    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3

    @property
    def gone(self) -> bool:
        return self >= MemberState.DEAD


@dataclass(frozen=True, order=False)
class Member:
    peer_id: bytes
    incarnation: int
    state: MemberState
    host: str
    port: int
    region: str

    def __post_init__(self) -> None:
        if len(self.peer_id) != PEER_ID_BYTES:
            raise ValueError(f"peer_id must be {PEER_ID_BYTES} bytes")
        if not 0 <= self.incarnation <= MAX_INCARNATION:
            raise ValueError("incarnation out of range")

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def short_id(self) -> str:
        return self.peer_id[:4].hex()

    def key(self) -> tuple:
        return (self.incarnation, int(self.state), self.host, self.port, self.region)

    def with_state(self, state: MemberState, incarnation: int | None = None) -> "Member":
        inc = self.incarnation if incarnation is None else incarnation
        return Member(self.peer_id, inc, state, self.host, self.port, self.region)

    def to_wire(self) -> list:
        return [self.peer_id, self.incarnation, int(self.state), self.host, self.port, self.region]

    @classmethod
    def from_wire(cls, obj: object) -> "Member":
        if not isinstance(obj, list) or len(obj) != 6:
            raise ProtocolError("member entry: expected a list of 6 fields")
        d = dict(zip(("id", "inc", "state", "host", "port", "region"), obj))
        return cls(
            peer_id=get_bytes(d, "id", PEER_ID_BYTES, PEER_ID_BYTES),
            incarnation=get_int(d, "inc", 0, MAX_INCARNATION),
            state=MemberState(get_int(d, "state", 0, len(MemberState) - 1)),
            host=get_str(d, "host", MAX_HOST_LEN),
            port=get_int(d, "port", 0, 65535),
            region=get_str(d, "region", MAX_REGION_LEN),
        )


def members_from_wire(d: dict, key: str, max_len: int) -> tuple[Member, ...]:
    return tuple(Member.from_wire(x) for x in get_list(d, key, max_len))


def merge_entry(a: Member | None, b: Member | None) -> Member | None:
    """The larger of two entries about the same peer (None: no entry)."""
    if a is None:
        return b
    if b is None:
        return a
    if a.peer_id != b.peer_id:
        raise ValueError("merge_entry: entries about different peers")
    return b if b.key() > a.key() else a


def merge_tables(a: dict[bytes, Member], b: dict[bytes, Member]) -> dict[bytes, Member]:
    """Per-peer merge of two membership views."""
    out = dict(a)
    for pid, m in b.items():
        out[pid] = merge_entry(out.get(pid), m)
    return out


@dataclass(frozen=True)
class Update:
    """A gossiped membership entry with the peer that declared it (for suspicions, the
    suspector: Lifeguard counts distinct suspectors as independent confirmations)."""

    member: Member
    by: bytes

    def to_wire(self) -> list:
        return self.member.to_wire() + [self.by]

    @classmethod
    def from_wire(cls, obj: object) -> "Update":
        if not isinstance(obj, list) or len(obj) != 7:
            raise ProtocolError("update: expected a list of 7 fields")
        by = get_bytes({"by": obj[6]}, "by", PEER_ID_BYTES, PEER_ID_BYTES)
        return cls(Member.from_wire(obj[:6]), by)


def updates_from_wire(d: dict, key: str, max_len: int) -> tuple[Update, ...]:
    return tuple(Update.from_wire(x) for x in get_list(d, key, max_len))
