"""SWIM failure detector and membership with Lifeguard, as a sans-IO state machine.

`Swim` does no I/O and reads no clock: the caller passes `now`, feeds it received messages
with `handle(src, msg, now)`, calls `tick(now)` at `next_deadline()`, and sends the `Send`s both
return. The same machine runs over the real transport (GossipService) and over the in-memory
harness under MockClock.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from .broadcast import BroadcastQueue
from .config import GossipConfig
from .members import Member, MemberState, Update, merge_entry
from .messages import Ack, Gossip, Nack, Ping, PingReq, PushPull, SwimMessage
from .suspicion import Suspicion

__all__ = ["Swim", "Send"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Send:
    to: bytes
    address: tuple[str, int] | None  # where to connect if there is no connection yet
    msg: SwimMessage


@dataclass
class _Probe:
    target: Member
    seq: int
    timeout_at: float
    end_at: float
    acked: bool = False
    indirect_sent: bool = False
    nacks_expected: int = 0
    nacks: int = 0


@dataclass
class _Relay:
    requester: bytes
    orig_seq: int
    nack_at: float
    expire_at: float
    nacked: bool = False


class Swim:
    def __init__(self, config: GossipConfig, me: Member, rng: random.Random, now: float) -> None:
        self.config = config
        self.me_id = me.peer_id
        self.members: dict[bytes, Member] = {me.peer_id: me.with_state(MemberState.ALIVE)}
        self.changed_at: dict[bytes, float] = {me.peer_id: now}
        self.broadcasts = BroadcastQueue()
        self.suspicions: dict[bytes, Suspicion] = {}
        self.awareness = 0
        self.leaving = False
        self._rng = rng
        self._seq = 0
        self._probe_order: list[bytes] = []
        self._probe_index = 0
        self._probe: _Probe | None = None
        self._relays: dict[int, _Relay] = {}
        self._changes: list[Member] = []
        self._live = 1
        self._pool: list[bytes] | None = None  # every other member ever seen, for gossip targets
        self.broadcasts.queue(Update(self.me, self.me_id))  # announce ourselves
        self.next_probe = now + rng.uniform(0, config.probe_interval_s)
        self.next_gossip = now + rng.uniform(0, config.gossip_interval_s)
        pp = config.push_pull_interval_s
        self.next_push_pull = now + rng.uniform(0, pp) if pp > 0 else float("inf")

    # ---- queries

    @property
    def me(self) -> Member:
        return self.members[self.me_id]

    def live_count(self) -> int:
        """Members not dead or left, ourselves included."""
        return self._live

    def live_members(self) -> list[Member]:
        return [m for m in self.members.values() if not m.state.gone]

    def address_of(self, peer_id: bytes) -> tuple[str, int] | None:
        m = self.members.get(peer_id)
        return m.address if m else None

    def drain_changes(self) -> list[Member]:
        """Entries whose state changed since the last call (for observers)."""
        out, self._changes = self._changes, []
        return out

    def next_deadline(self) -> float:
        t = min(self.next_probe, self.next_push_pull)
        if len(self.broadcasts):  # nothing to gossip: no need to wake up for it
            t = min(t, self.next_gossip)
        p = self._probe
        if p is not None and not p.acked:
            t = min(t, p.end_at if p.indirect_sent else p.timeout_at)
        for r in self._relays.values():
            t = min(t, r.expire_at if r.nacked else r.nack_at)
        for s in self.suspicions.values():
            t = min(t, s.deadline)
        return t

    def _multiplier(self) -> int:
        return self.awareness + 1

    def _adjust_awareness(self, delta: int) -> None:
        top = self.config.awareness_max_multiplier - 1
        self.awareness = max(0, min(top, self.awareness + delta))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _piggyback(self, *extra: Update) -> tuple[Update, ...]:
        limit = self.config.retransmit_limit(self.live_count())
        taken = self.broadcasts.take(self.config.max_piggyback_bytes, limit)
        return tuple(extra) + tuple(u for u in taken if all(u.member.peer_id != e.member.peer_id for e in extra))

    def _direct(self, target: Member | None = None) -> tuple[Update, ...]:
        """Piggyback for a direct ping or ack: our own current entry always (so whoever still
        suspects us hears our refutation at the next contact) and, pinging a suspect, its
        suspicion (Lifeguard's buddy system: it can refute at once)."""
        extra = [Update(self.me, self.me_id)]
        if target is not None and target.state == MemberState.SUSPECT:
            extra.append(Update(target, self.me_id))
        return self._piggyback(*extra)

    def _send(self, to: Member | bytes, msg: SwimMessage) -> Send:
        if isinstance(to, Member):
            return Send(to.peer_id, to.address, msg)
        return Send(to, self.address_of(to), msg)

    # ---- membership changes

    def add_seed(self, peer_id: bytes, host: str, port: int, region: str, now: float) -> list[Send]:
        """A peer reached through a bootstrap address: record it and push-pull with it."""
        if peer_id != self.me_id and peer_id not in self.members:
            self._apply(Update(Member(peer_id, 0, MemberState.ALIVE, host, port, region), peer_id), now)
        return [self._send(peer_id, PushPull(tuple(self.members.values()), reply=True))]

    def leave(self, now: float) -> list[Send]:
        """Announce a graceful leave; gossip it at once to a few members."""
        if self.leaving:
            return []
        self.leaving = True
        self._live -= 1
        left = self.me.with_state(MemberState.LEFT)
        self.members[self.me_id] = left
        self._changes.append(left)
        self.broadcasts.queue(Update(left, self.me_id))
        return self._gossip_round(now)

    def _apply(self, u: Update, now: float) -> bool:
        m = u.member
        if m.peer_id == self.me_id:
            self._apply_about_me(m)
            return False
        old = self.members.get(m.peer_id)
        new = merge_entry(old, m)
        if new is old:
            s = self.suspicions.get(m.peer_id)
            if (s is not None and old is not None and old.state == MemberState.SUSPECT
                    and m.state == MemberState.SUSPECT and m.incarnation == old.incarnation
                    and s.confirm(u.by, now)):
                self.broadcasts.queue(u)
            return False
        self.members[m.peer_id] = new
        self.changed_at[m.peer_id] = now
        self._live += (0 if old is None or old.state.gone else -1) + (0 if new.state.gone else 1)
        if old is None or old.state != new.state:
            self._changes.append(new)
            logger.debug("member %s: %s -> %s (inc %d)", new.short_id,
                         old.state.name if old else "-", new.state.name, new.incarnation)
        if old is None:
            self._pool = None
            pos = self._rng.randint(self._probe_index, len(self._probe_order))
            self._probe_order.insert(pos, m.peer_id)
        if new.state == MemberState.SUSPECT:
            n = self.live_count()
            k = int(self.config.suspicion_mult) - 2
            if n - 2 < k:
                k = 0
            self.suspicions[m.peer_id] = Suspicion(
                u.by, k, self.config.suspicion_min_s(n), self.config.suspicion_max_s(n), now)
        else:
            self.suspicions.pop(m.peer_id, None)
        self.broadcasts.queue(Update(new, u.by))
        return True

    def _apply_about_me(self, m: Member) -> None:
        me = self.me
        if self.leaving:
            return
        if m.key() <= me.key() and m.state == MemberState.ALIVE:
            return
        if m.incarnation < me.incarnation:
            return
        # Someone holds a suspicion, a death or a newer life of us: refute with a higher
        # incarnation (Lifeguard: being suspected also counts against our own health).
        if m.state != MemberState.ALIVE:
            self._adjust_awareness(1)
        new = Member(self.me_id, m.incarnation + 1, MemberState.ALIVE, me.host, me.port, me.region)
        self.members[self.me_id] = new
        logger.debug("refuting %s about us at incarnation %d", m.state.name, new.incarnation)
        self.broadcasts.queue(Update(new, self.me_id))

    def _apply_all(self, updates, now: float) -> None:
        for u in updates:
            self._apply(u, now)

    # ---- messages

    def handle(self, src: bytes, msg: SwimMessage, now: float) -> list[Send]:
        """Feed one received message; src is the authenticated sender."""
        if isinstance(msg, PushPull):
            for m in msg.members:
                self._apply(Update(m, src), now)
            if msg.reply:
                return [self._send(src, PushPull(tuple(self.members.values()), reply=False))]
            return []
        if isinstance(msg, Nack):
            p = self._probe
            if p is not None and p.seq == msg.seq:
                p.nacks += 1
            return []
        self._apply_all(msg.updates, now)
        if isinstance(msg, Ping):
            if msg.target != self.me_id or self.leaving:
                return []
            return [self._send(src, Ack(msg.seq, self._direct()))]
        if isinstance(msg, Ack):
            return self._on_ack(msg, now)
        if isinstance(msg, PingReq):
            seq = self._next_seq()
            t = self.config.probe_timeout_s
            self._relays[seq] = _Relay(src, msg.seq, now + 0.8 * t, now + t)
            return [self._send(msg.target, Ping(seq, msg.target.peer_id, self._piggyback()))]
        return []  # Gossip: updates applied above

    def _on_ack(self, msg: Ack, now: float) -> list[Send]:
        p = self._probe
        if p is not None and p.seq == msg.seq and not p.acked:
            p.acked = True
            self._adjust_awareness(-1)
            return []
        r = self._relays.pop(msg.seq, None)
        if r is not None:
            return [self._send(r.requester, Ack(r.orig_seq))]
        return []

    # ---- timers

    def tick(self, now: float) -> list[Send]:
        out: list[Send] = []
        self._tick_relays(now, out)
        self._tick_suspicions(now)
        self._tick_probe(now, out)
        if now >= self.next_probe:
            self._finish_probe(now)
            self._start_probe(now, out)
        if now >= self.next_gossip:
            if len(self.broadcasts):
                out.extend(self._gossip_round(now))
            self.next_gossip = now + self.config.gossip_interval_s
        if now >= self.next_push_pull:
            self.next_push_pull = now + self.config.push_pull_scaled_s(self.live_count())
            target = self._random_members(1, exclude=())
            if target:
                out.append(self._send(target[0], PushPull(tuple(self.members.values()), reply=True)))
        return out

    def _tick_relays(self, now: float, out: list[Send]) -> None:
        for seq, r in list(self._relays.items()):
            if now >= r.expire_at:
                del self._relays[seq]
            elif not r.nacked and now >= r.nack_at:
                r.nacked = True
                out.append(self._send(r.requester, Nack(r.orig_seq)))

    def _tick_suspicions(self, now: float) -> None:
        for pid, s in list(self.suspicions.items()):
            if now < s.deadline:
                continue
            del self.suspicions[pid]
            m = self.members[pid]
            if m.state == MemberState.SUSPECT:
                logger.info("member %s: suspicion timed out, marking dead", m.short_id)
                self._apply(Update(m.with_state(MemberState.DEAD), self.me_id), now)

    def _tick_probe(self, now: float, out: list[Send]) -> None:
        p = self._probe
        if p is None or p.acked or p.indirect_sent or now < p.timeout_at:
            return
        p.indirect_sent = True
        relays = self._random_members(self.config.indirect_checks, exclude=(p.target.peer_id,))
        p.nacks_expected = len(relays)
        for m in relays:
            out.append(self._send(m, PingReq(p.seq, p.target, self._piggyback())))
        if now >= p.end_at:
            self._finish_probe(now)

    def _finish_probe(self, now: float) -> None:
        p = self._probe
        if p is None:
            return
        if not p.acked and now < p.end_at:
            return
        self._probe = None
        if p.acked:
            return
        # Lifeguard: relays that did not even nack suggest that we are the slow one.
        self._adjust_awareness(p.nacks_expected - p.nacks if p.nacks_expected else 1)
        cur = self.members.get(p.target.peer_id)
        if cur is None or cur.state.gone or cur.incarnation != p.target.incarnation:
            return
        if cur.state == MemberState.ALIVE:
            logger.info("member %s: no ack, suspecting", cur.short_id)
        self._apply(Update(cur.with_state(MemberState.SUSPECT), self.me_id), now)

    def _start_probe(self, now: float, out: list[Send]) -> None:
        mult = self._multiplier()
        self.next_probe = now + self.config.probe_interval_s * mult
        if self.leaving:
            return
        target = self._next_target()
        if target is None:
            return
        seq = self._next_seq()
        self._probe = _Probe(target, seq, now + self.config.probe_timeout_s * mult,
                             now + self.config.probe_interval_s * mult)
        out.append(self._send(target, Ping(seq, target.peer_id, self._direct(target))))

    def _next_target(self) -> Member | None:
        for _ in range(len(self._probe_order) + 1):
            if self._probe_index >= len(self._probe_order):
                self._probe_order = [pid for pid in self._probe_order
                                     if not self.members[pid].state.gone]
                self._rng.shuffle(self._probe_order)
                self._probe_index = 0
                if not self._probe_order:
                    return None
            pid = self._probe_order[self._probe_index]
            self._probe_index += 1
            m = self.members[pid]
            if not m.state.gone:
                return m
        return None

    def _random_members(self, k: int, exclude) -> list[Member]:
        pool = [m for m in self.members.values()
                if m.peer_id != self.me_id and not m.state.gone and m.peer_id not in exclude]
        return self._rng.sample(pool, min(k, len(pool)))

    def _gossip_round(self, now: float) -> list[Send]:
        if not len(self.broadcasts):
            return []
        if self._pool is None:
            self._pool = [pid for pid in self.members if pid != self.me_id]
        # Sample a few more than needed and keep the eligible ones (memberlist's
        # kRandomNodes): live members, and the dead or left for gossip_to_dead_s.
        k = self.config.gossip_nodes
        cands = self._rng.sample(self._pool, min(len(self._pool), 2 * k + 2))
        targets = [self.members[p] for p in cands if not self.members[p].state.gone
                   or now - self.changed_at.get(p, now) < self.config.gossip_to_dead_s][:k]
        out = []
        for m in targets:
            ups = self._piggyback()
            if not ups:
                break
            out.append(self._send(m, Gossip(ups)))
        return out
