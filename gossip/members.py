"""Membership entries (the view every member holds) and their order.

A member's entry is ordered by (incarnation, state rank, address, region), with
alive < suspect < dead < left at one incarnation; a live peer refutes with a higher
incarnation, which beats all of them. `merge_entry` keeps the larger of two entries: a join
(commutative, idempotent, monotone). The swarm does not merge entries it is told, though:
an entry is built from signed claims and accusations under the rules of `claims.py` and
`swim.py`, and `Claim.key()` orders a peer's own claims the same way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import overload

from dtfm.net import PEER_ID_BYTES

__all__ = ["MemberState", "Member", "merge_entry", "merge_tables", "MAX_INCARNATION", "MAX_HOST_LEN",
           "MAX_REGION_LEN"]

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


@overload
def merge_entry(a: Member | None, b: Member) -> Member: ...
@overload
def merge_entry(a: Member | None, b: Member | None) -> Member | None: ...


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
