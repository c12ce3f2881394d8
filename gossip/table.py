"""The membership table: each member's newest signed claim, the accusation its state rests
on, and the derived `Member` view; which members are confirmed (answered a ping at the address
they claim); removal of long-gone members, with tombstones.

Pure bookkeeping: which update may change an entry is decided in `swim.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .claims import Accusation, Claim, Update
from .members import Member, MemberState

__all__ = ["Entry", "MemberTable"]


@dataclass(frozen=True)
class Entry:
    claim: Claim  # the member's own newest claim (alive or left)
    accusation: Accusation | None  # what a suspect or dead state rests on, at claim.incarnation
    state: MemberState
    changed_at: float  # when the state or the claim last changed
    member: Member  # the view: the claim's fields with the state


class MemberTable:
    def __init__(self) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.members: dict[bytes, Member] = {}
        self.live = 0  # entries neither dead nor left
        self.confirmed_live = 0  # of those, the confirmed ones
        self._gone: dict[bytes, float] = {}  # dead or left -> since, oldest first
        self._confirmed: set[bytes] = set()
        self._tombstones: dict[bytes, tuple[Claim, float]] = {}  # removed -> (last claim, when), oldest first

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, peer_id: bytes) -> Entry | None:
        return self.entries.get(peer_id)

    def set(self, claim: Claim, accusation: Accusation | None, state: MemberState,
            now: float) -> Entry | None:
        """Store an entry; the one it replaced (None: a new member)."""
        pid = claim.peer_id
        m = claim.member()
        if m.state != state:
            m = m.with_state(state)
        old = self.entries.get(pid)
        self.entries[pid] = Entry(claim, accusation, state, now, m)
        self.members[pid] = m
        self._tombstones.pop(pid, None)
        was_live = old is not None and not old.state.gone
        self.live += (not state.gone) - was_live
        if old is not None and pid in self._confirmed:
            self.confirmed_live += (not state.gone) - was_live
        if state.gone and (old is None or not old.state.gone):
            self._gone[pid] = now
        elif not state.gone:
            self._gone.pop(pid, None)
        return old

    def confirm(self, peer_id: bytes) -> bool:
        """Mark a member confirmed (for as long as it stays in the table); True if it was not."""
        if peer_id not in self.entries or peer_id in self._confirmed:
            return False
        self._confirmed.add(peer_id)
        self.confirmed_live += not self.entries[peer_id].state.gone
        return True

    def is_confirmed(self, peer_id: bytes) -> bool:
        return peer_id in self._confirmed

    def gone(self) -> list[bytes]:
        """Dead and left members, longest gone first."""
        return list(self._gone)

    def remove(self, peer_id: bytes, now: float, *, tombstone: bool = True) -> None:
        """Take a member out at once (to make room), keeping a tombstone of its claim (unless
        told not to: a member refused for its address group's cap may come back as it is)."""
        e = self.entries.pop(peer_id)
        del self.members[peer_id]
        self._gone.pop(peer_id, None)
        self.live -= not e.state.gone
        if peer_id in self._confirmed:
            self._confirmed.discard(peer_id)
            self.confirmed_live -= not e.state.gone
        if tombstone:
            self._tombstones[peer_id] = (e.claim, now)

    def reap(self, now: float, after_s: float) -> list[bytes]:
        """Remove members dead or left for after_s or longer, keeping a tombstone of each."""
        out = []
        for pid, since in self._gone.items():
            if now - since < after_s:
                break
            out.append(pid)
        for pid in out:
            self.remove(pid, now)
        return out

    def expire_tombstones(self, now: float, keep_s: float, max_count: int) -> None:
        while self._tombstones:
            pid, (_, at) = next(iter(self._tombstones.items()))
            if now - at < keep_s and len(self._tombstones) <= max_count:
                break
            del self._tombstones[pid]

    def tombstone_count(self) -> int:
        return len(self._tombstones)

    def tombstone(self, peer_id: bytes) -> Claim | None:
        """The last claim of a removed member."""
        t = self._tombstones.get(peer_id)
        return t[0] if t is not None else None

    def updates(self, first: bytes) -> list[Update]:
        """The full state we vouch for as updates: `first`'s claim, the other confirmed members'
        claims, then the accusations about them (a receiver knows the accused and the accusers
        before it reads an accusation). Unconfirmed members are left out: we pass on only
        members that answered us at their address (so within our caps per address group), and
        a peer that joins through us inherits none of a flood's fakes."""
        confirmed = self._confirmed
        claims = [self.entries[first].claim]
        claims += [e.claim for pid, e in self.entries.items() if pid != first and pid in confirmed]
        return claims + [e.accusation for pid, e in self.entries.items()
                         if e.accusation is not None and pid in confirmed]
