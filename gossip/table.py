"""The membership table: each member's newest signed claim, the accusation its state rests
on, and the derived `Member` view; removal of long-gone members, with tombstones.

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
        self._gone: dict[bytes, float] = {}  # dead or left -> since, oldest first
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
        if state.gone and (old is None or not old.state.gone):
            self._gone[pid] = now
        elif not state.gone:
            self._gone.pop(pid, None)
        return old

    def reap(self, now: float, after_s: float) -> list[bytes]:
        """Remove members dead or left for after_s or longer, keeping a tombstone of each."""
        out = []
        for pid, since in self._gone.items():
            if now - since < after_s:
                break
            out.append(pid)
        for pid in out:
            del self._gone[pid]
            e = self.entries.pop(pid)
            del self.members[pid]
            self._tombstones[pid] = (e.claim, now)
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
        """The full state as updates: `first`'s claim, the other claims, then the accusations
        (a receiver knows the accused and the accusers before it reads an accusation)."""
        claims = [self.entries[first].claim]
        claims += [e.claim for pid, e in self.entries.items() if pid != first]
        return claims + [e.accusation for e in self.entries.values() if e.accusation is not None]
