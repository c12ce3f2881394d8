"""The membership rules of SWIM over signed updates, without the protocol around them.

`Membership` holds the table and decides what each received claim or accusation does to it
(`swim.py`'s docstring lists the rules); `Swim` adds probes, messages and timers on top.

- a member enters the table only with its own claim; the claim spends a token of its
  remote address's admission rate, and of the source's when the source is not the member
  itself (`admission.py`);
- an address group holds at most its cap of confirmed members (`caps.py`): a new member's
  claim at an address whose group is at its cap is refused, and so is its confirmation when
  the group filled up meanwhile (it is taken out of the table, without a tombstone: it may
  come back when there is room). Dead and left members do not count, so one that comes back
  alive into a group filled meanwhile is refused. Members `protected` names are confirmed
  whatever the cap;
- the table holds at most `max_members`; when it is full, a new member takes the place of,
  in this order: the member dead or left the longest; the longest-held unconfirmed member of
  the address group most of the unconfirmed members came in from; the confirmed member
  counted last in the address group that holds the most confirmed members, if it holds more
  than the newcomer's would with it. Never ourselves or a member `protected`
  names (the daemon: the peers the current allocation names and the election's voters); with
  no such place the claim is refused;
- a member is *confirmed* once it acked a ping sent over a connection dialled to the address
  it claims (`Swim`'s verification); only confirmed members count as alive (`live_count`,
  `live_members`), are reported to observers (`drain_changes`) and are passed on to others
  (broadcasts and push-pull carry the claims of confirmed members only, so what we relay
  obeys our caps, and a joiner inherits none of a flood's fakes);
- a claim replaces the held one only if it orders after it (newer incarnation, left over
  alive) and raises the incarnation by at most `max_incarnation_jump`;
- an accusation counts only for the incarnation whose claim we hold and only from a member we
  know; it makes the accused suspect, and distinct verified accusers confirm the suspicion.
  Dead is only ever our own conclusion, when our suspicion times out: a dead accusation from
  someone else is one more confirmation;
- a member refutes an accusation of its current incarnation, and a claim of its own (from an
  earlier life) newer than its current one, with a claim one incarnation higher;
- dead and left members are removed `reap_after_s` after they went; their last claim stays
  as a tombstone for `tombstone_s` so older claims are refused.

Signatures are checked only for updates that would change the table (a held or older one is
dropped first), through a `ClaimVerifier` that remembers the valid ones.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from .admission import admission_buckets
from .broadcast import BroadcastQueue
from .caps import Arrivals, GroupCaps
from .claims import Accusation, Claim, ClaimVerifier, Update
from .config import GossipConfig
from .members import MAX_INCARNATION, Member, MemberState
from .suspicion import Suspicion
from .table import MemberTable

if TYPE_CHECKING:
    from dtfm.net import Identity

__all__ = ["Membership"]

logger = logging.getLogger(__name__)


class Membership:
    def __init__(self, config: GossipConfig, identity: Identity, me: Member, now: float, *,
                 verifier: ClaimVerifier | None = None) -> None:
        if me.peer_id != identity.peer_id:
            raise ValueError("me must be the identity's own entry")
        self.config = config
        self.identity = identity
        self.me_id = me.peer_id
        self.table = MemberTable()
        self.verifier = verifier or ClaimVerifier()
        self.admission = admission_buckets(config.new_members_per_s, config.new_member_burst, config.max_members)
        self.address_admission = admission_buckets(config.new_members_per_address_per_s,
                                                   config.new_member_burst_per_address, config.max_members)
        self.caps = GroupCaps(config)  # confirmed members per address group
        self.arrivals = Arrivals()  # unconfirmed members per address group they came in from
        # Members never evicted to make room (the daemon passes the peers its allocation names).
        self.protected: Callable[[bytes], bool] = _nobody
        self.refused: Counter[str] = Counter()  # updates refused, by reason
        self.evicted = 0  # members removed to make room for new ones
        self.broadcasts = BroadcastQueue()
        self.suspicions: dict[bytes, Suspicion] = {}
        self.awareness = 0  # Lifeguard's local health score
        self.leaving = False
        self._changes: list[Member] = []
        claim = self._sign(me.incarnation, MemberState.ALIVE, me.host, me.port, me.region)
        self.table.set(claim, None, MemberState.ALIVE, now)
        self.table.confirm(self.me_id)
        self.broadcasts.queue(claim)  # announce ourselves

    def _on_new_member(self, peer_id: bytes) -> None:
        """Called when a member enters the table."""

    def _on_confirmed(self, peer_id: bytes) -> None:
        """Called when a member is confirmed."""

    def _on_unconfirmed_address(self, peer_id: bytes, group: str | None) -> None:
        """Called when an unconfirmed member enters the table or claims another address;
        group: the address group its claim came from (None: not known)."""

    def _on_removed(self, peer_id: bytes) -> None:
        """Called when a member leaves the table (reaped)."""

    # ---- queries

    @property
    def members(self) -> dict[bytes, Member]:
        """Every member in the table (ourselves included), as the view of its entry."""
        return self.table.members

    @property
    def me(self) -> Member:
        return self.table.members[self.me_id]

    def live_count(self) -> int:
        """Members that count as alive: confirmed, not dead or left, ourselves included."""
        return self.table.confirmed_live

    def live_members(self) -> list[Member]:
        """Members that count as alive (see live_count)."""
        confirmed = self.table.is_confirmed
        return [m for m in self.table.members.values() if not m.state.gone and confirmed(m.peer_id)]

    def is_confirmed(self, peer_id: bytes) -> bool:
        """Whether peer_id acked a ping at the address it claims (we are, always)."""
        return self.table.is_confirmed(peer_id)

    def address_of(self, peer_id: bytes) -> tuple[str, int] | None:
        m = self.table.members.get(peer_id)
        return m.address if m else None

    def drain_changes(self) -> list[Member]:
        """Confirmed members whose state changed, and members confirmed, since the last call
        (for observers): a member is first reported when it is confirmed."""
        out, self._changes = self._changes, []
        return out

    def _confirm(self, peer_id: bytes, now: float) -> None:
        """Confirm a member that answered at its address, within its address groups' caps (of
        live members: the dead and left do not count); over a cap it is taken out (refused)."""
        m = self.table.members.get(peer_id)
        if m is None or self.table.is_confirmed(peer_id):
            return
        full = None if self.protected(peer_id) else self.caps.full(m.host, self._live)
        if full is not None:
            self.refused["address group at its cap of members"] += 1
            logger.debug("member %s: not confirmed at %s:%d: its address group %s holds %d live members, "
                         "its cap", m.short_id, m.host, m.port, full[0], self.caps.cap(full[1]))
            self._remove(peer_id, now, tombstone=False)  # it may come back when there is room
            return
        if self.table.confirm(peer_id):
            self.caps.add(peer_id, m.host)
            self.arrivals.remove(peer_id)
            logger.debug("member %s: confirmed at %s:%d", m.short_id, m.host, m.port)
            self._changes.append(m)
            self.broadcasts.queue(self.table.entries[peer_id].claim)  # now we vouch for it
            self._on_confirmed(peer_id)

    def _over_cap(self, peer_id: bytes) -> bool:
        """Whether a confirmed member now dead or left would pass a cap coming back alive."""
        if self.protected(peer_id):
            return False
        return any(self.caps.count(g, self._live) >= self.caps.cap(kind) for g, kind in self.caps.groups_of(peer_id))

    def _live(self, peer_id: bytes) -> bool:
        e = self.table.entries.get(peer_id)
        return e is not None and not e.state.gone

    def _adjust_awareness(self, delta: int) -> None:
        top = self.config.awareness_max_multiplier - 1
        self.awareness = max(0, min(top, self.awareness + delta))

    def _sign(self, incarnation: int, state: MemberState, host: str, port: int, region: str) -> Claim:
        c = Claim.create(self.identity, incarnation, state, host, port, region)
        self.verifier.remember(c)
        return c

    def _accuse(self, accused: bytes, incarnation: int, state: MemberState) -> Accusation:
        a = Accusation.create(self.identity, accused, incarnation, state)
        self.verifier.remember(a)
        return a

    def _claim_me(self, claim: Claim, now: float) -> None:
        self._set(claim, None, claim.state, now, announce=claim)

    def set_address(self, host: str, port: int, now: float) -> None:
        """Advertise host:port from now on: a new claim one incarnation up."""
        me = self.me
        if me.address == (host, port) or self.leaving or me.incarnation >= MAX_INCARNATION:
            return
        self._claim_me(self._sign(me.incarnation + 1, MemberState.ALIVE, host, port, me.region), now)

    # ---- applying updates

    def _refuse(self, u: Update, src: bytes, reason: str) -> None:
        self.refused[reason] += 1
        logger.debug("%s about %s from %s refused: %s", type(u).__name__.lower(), u.subject[:4].hex(),
                     src[:4].hex(), reason)

    def _set(self, claim: Claim, acc: Accusation | None, state: MemberState, now: float, *,
             announce: Update, group: str | None = None) -> None:
        pid = claim.peer_id
        old = self.table.set(claim, acc, state, now)
        new = self.table.members[pid]
        if (old is None or old.state != state) and self.table.is_confirmed(pid):
            self._changes.append(new)
            logger.debug("member %s: %s -> %s (inc %d)", new.short_id,
                         old.state.name if old else "-", state.name, new.incarnation)
        if old is None and pid != self.me_id:
            self.arrivals.add(pid, group)
            self._on_new_member(pid)
        if (old is None or old.member.address != new.address) and not self.table.is_confirmed(pid):
            self._on_unconfirmed_address(pid, group)
        if state != MemberState.SUSPECT:
            self.suspicions.pop(pid, None)
        if isinstance(announce, Accusation) or self.table.is_confirmed(pid):
            self.broadcasts.queue(announce)  # claims: only of members we verified (our caps)

    def _apply(self, u: Update, src: bytes, now: float, group: str | None = None) -> None:
        """group: the address group of the connection u came over (None: not known)."""
        if isinstance(u, Claim):
            self._apply_claim(u, src, now, group)
        else:
            self._apply_accusation(u, src, now)

    def _room_for(self, host: str) -> bytes | None:
        """The member to remove for a new one at host when the table is full: the longest
        gone; else the longest-held unconfirmed member of the address group most unconfirmed
        members came in from; else the confirmed member counted last in the address group
        that holds the most, if it holds more than host's groups would with the newcomer (a
        host with one member is never over-represented). Never ourselves or a protected
        member. None: no room."""
        for pid in self.table.gone():
            if pid != self.me_id and not self.protected(pid):
                return pid
        unconfirmed = self.arrivals.oldest_of_largest(self._evictable)
        if unconfirmed is not None:
            return unconfirmed
        fullest = self.caps.fullest(self._evictable)
        if fullest is not None and fullest[0] > self.caps.largest(host) + 1:
            return fullest[1]
        return None

    def _evictable(self, peer_id: bytes) -> bool:
        return peer_id != self.me_id and not self.protected(peer_id)

    def _apply_claim(self, c: Claim, src: bytes, now: float, group: str | None = None) -> None:
        pid = c.peer_id
        if pid == self.me_id:
            self._claim_about_me(c, src, now)
            return
        e = self.table.get(pid)
        evict: bytes | None = None
        if e is not None:
            if c == e.claim or c.key() <= e.claim.key():
                return  # held already, or older
            if c.incarnation - e.claim.incarnation > self.config.max_incarnation_jump:
                return self._refuse(c, src, "incarnation jump too large")
            if e.state.gone and not c.state.gone and self._over_cap(pid):
                return self._refuse(c, src, "address group at its cap of members")  # its place was taken
        else:
            t = self.table.tombstone(pid)
            if t is not None and c.key() <= t.key():
                return self._refuse(c, src, "not newer than the claim of a removed member")
            if src != pid and self.admission.tokens(src, now) < 1:
                return self._refuse(c, src, "source over its rate of new members")
            if group is not None and self.address_admission.tokens(group, now) < 1:
                return self._refuse(c, src, "address over its rate of new members")
            if self.caps.full(c.host, self._live) is not None and not self.protected(pid):
                return self._refuse(c, src, "address group at its cap of members")
            if len(self.table) >= self.config.max_members:
                evict = self._room_for(c.host)
                if evict is None:
                    return self._refuse(c, src, "member table full")
        if not self.verifier.verify(c):
            return self._refuse(c, src, "bad signature")
        if e is None:
            if src != pid:
                self.admission.take(src, now)
            if group is not None:
                self.address_admission.take(group, now)
            if evict is not None:
                self._evict(evict, now)
        if e is not None and c.incarnation == e.claim.incarnation and c.state == MemberState.ALIVE:
            self._set(c, e.accusation, e.state, now, announce=c, group=group)  # an accusation of it stands
        else:
            self._set(c, None, c.state, now, announce=c, group=group)

    def _apply_accusation(self, a: Accusation, src: bytes, now: float) -> None:
        pid = a.accused
        if pid == self.me_id:
            self._accusation_about_me(a, src, now)
            return
        e = self.table.get(pid)
        if e is None or e.state.gone:
            return  # unknown, or gone already
        if a.incarnation != e.claim.incarnation:
            if a.incarnation > e.claim.incarnation:
                self._refuse(a, src, "accuses an incarnation never claimed")
            return  # else: refuted already
        if a.accuser != self.me_id and a.accuser not in self.table.entries:
            return self._refuse(a, src, "accuser is not a member")
        s = self.suspicions.get(pid)
        if s is not None and a.accuser in s.confirmers:
            return
        if not self.verifier.verify(a):
            return self._refuse(a, src, "bad signature")
        if s is not None:
            if s.confirm(a.accuser, now):
                self.broadcasts.queue(a)
            return
        n = self.live_count()
        k = int(self.config.suspicion_mult) - 2
        if n - 2 < k:
            k = 0
        self.suspicions[pid] = Suspicion(a.accuser, k, self.config.suspicion_min_s(n),
                                         self.config.suspicion_max_s(n), now)
        self._set(e.claim, a, MemberState.SUSPECT, now, announce=a)

    def _claim_about_me(self, c: Claim, src: bytes, now: float) -> None:
        mine = self.table.entries[self.me_id].claim
        if self.leaving or c == mine or c.key() <= mine.key():
            return
        if not self.verifier.verify(c):
            return self._refuse(c, src, "bad signature")
        # Our own claim from an earlier life, newer than our current one: refute above it.
        self._refute(c.incarnation, c.state != MemberState.ALIVE, now)

    def _accusation_about_me(self, a: Accusation, src: bytes, now: float) -> None:
        if self.leaving or a.incarnation != self.me.incarnation:
            return  # refuted already, or about an incarnation we never claimed
        if not self.verifier.verify(a):
            return self._refuse(a, src, "bad signature")
        self._refute(a.incarnation, True, now)

    def _refute(self, incarnation: int, accused: bool, now: float) -> None:
        if incarnation >= MAX_INCARNATION:
            logger.warning("cannot refute at incarnation %d: it is the largest", incarnation)
            return
        # Lifeguard: being accused also counts against our own health.
        if accused:
            self._adjust_awareness(1)
        me = self.me
        logger.debug("refuting incarnation %d with %d", incarnation, incarnation + 1)
        self._claim_me(self._sign(incarnation + 1, MemberState.ALIVE, me.host, me.port, me.region), now)

    def _tombstone_of(self, peer_id: bytes) -> tuple[Update, ...]:
        """A removed peer's last claim, for that peer itself when it comes back at an older
        incarnation: it refutes above it, and its new claim is taken."""
        t = self.table.tombstone(peer_id) if peer_id not in self.table.entries else None
        return (t,) if t is not None else ()

    def _evict(self, peer_id: bytes, now: float) -> None:
        """Take a member out to make room in a full table (a tombstone stays)."""
        self._remove(peer_id, now, tombstone=True)
        self.evicted += 1
        logger.debug("member %s: removed to make room in a full table", peer_id[:4].hex())

    def _remove(self, peer_id: bytes, now: float, *, tombstone: bool) -> None:
        self.table.remove(peer_id, now, tombstone=tombstone)
        self.caps.remove(peer_id)
        self.arrivals.remove(peer_id)
        self.suspicions.pop(peer_id, None)
        self._on_removed(peer_id)

    def _reap(self, now: float) -> None:
        cfg = self.config
        for pid in self.table.reap(now, cfg.reap_after_s):
            self.caps.remove(pid)
            self.arrivals.remove(pid)
            self._on_removed(pid)
            self.suspicions.pop(pid, None)
            logger.debug("member %s: removed, gone for %g s", pid[:4].hex(), cfg.reap_after_s)
        self.table.expire_tombstones(now, cfg.tombstone_s, cfg.max_members)

    def _tick_suspicions(self, now: float) -> None:
        for pid, s in list(self.suspicions.items()):
            if now < s.deadline:
                continue
            del self.suspicions[pid]
            e = self.table.get(pid)
            if e is not None and e.state == MemberState.SUSPECT:
                logger.info("member %s: suspicion timed out, marking dead", e.member.short_id)
                a = self._accuse(pid, e.claim.incarnation, MemberState.DEAD)
                self._set(e.claim, a, MemberState.DEAD, now, announce=a)


def _nobody(peer_id: bytes) -> bool:
    return False
