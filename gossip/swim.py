"""SWIM failure detector and membership with Lifeguard, as a sans-IO state machine.

`Swim` does no I/O and reads no clock: the caller passes `now`, feeds it received messages
with `handle(src, msg, now)`, calls `tick(now)` at `next_deadline()`, and sends the `Send`s both
return. The same machine runs over the real transport (GossipService) and over the in-memory
harness under MockClock.

Membership is built from signed updates only (`claims.py`), under these rules:

- a member enters the table only with its own claim; a source other than the member itself
  spends a token of its admission rate (`admission.py`), and the table holds at most
  `max_members`;
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
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass

from .admission import AdmissionLimiter
from .broadcast import BroadcastQueue
from .claims import Accusation, Claim, ClaimVerifier, Update
from .config import GossipConfig
from .members import MAX_INCARNATION, Member, MemberState
from .messages import MAX_PUSH_PULL_UPDATES, Ack, Gossip, Nack, Ping, PingReq, PushPull, SwimMessage
from .suspicion import Suspicion
from .table import Entry, MemberTable

__all__ = ["Swim", "Send"]

logger = logging.getLogger(__name__)

_SEED_TRIES = 10  # push-pulls with a seed, one per probe interval, until its claim arrives


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
    def __init__(self, config: GossipConfig, identity, me: Member, rng: random.Random, now: float, *,
                 verifier: ClaimVerifier | None = None) -> None:
        if me.peer_id != identity.peer_id:
            raise ValueError("me must be the identity's own entry")
        self.config = config
        self.identity = identity
        self.me_id = me.peer_id
        self.table = MemberTable()
        self.verifier = verifier or ClaimVerifier()
        self.admission = AdmissionLimiter(config.new_members_per_s, config.new_member_burst,
                                          max_sources=config.max_members)
        self.refused: Counter[str] = Counter()  # updates refused, by reason
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
        self._pool: list[bytes] | None = None  # every other member in the table, for gossip targets
        self._seeds: dict[bytes, tuple[tuple[str, int], int]] = {}  # seed -> (address, tries left)
        claim = self._sign(me.incarnation, MemberState.ALIVE, me.host, me.port, me.region)
        self.table.set(claim, None, MemberState.ALIVE, now)
        self.broadcasts.queue(claim)  # announce ourselves
        self.next_probe = now + rng.uniform(0, config.probe_interval_s)
        self.next_gossip = now + rng.uniform(0, config.gossip_interval_s)
        pp = config.push_pull_interval_s
        self.next_push_pull = now + rng.uniform(0, pp) if pp > 0 else float("inf")

    # ---- queries

    @property
    def members(self) -> dict[bytes, Member]:
        """Every member in the table (ourselves included), as the view of its entry."""
        return self.table.members

    @property
    def me(self) -> Member:
        return self.table.members[self.me_id]

    def live_count(self) -> int:
        """Members not dead or left, ourselves included."""
        return self.table.live

    def live_members(self) -> list[Member]:
        return [m for m in self.table.members.values() if not m.state.gone]

    def address_of(self, peer_id: bytes) -> tuple[str, int] | None:
        m = self.table.members.get(peer_id)
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
        same = {(type(e), e.subject) for e in extra}
        return tuple(extra) + tuple(u for u in taken if (type(u), u.subject) not in same)

    def _direct(self, target: Member | None = None) -> tuple[Update, ...]:
        """Piggyback for a direct ping or ack: our own current claim always (so whoever still
        suspects us hears our refutation at the next contact) and, pinging a suspect, its
        claim and the accusation (Lifeguard's buddy system: it can refute at once)."""
        extra: list[Update] = [self.table.entries[self.me_id].claim]
        if target is not None and target.state == MemberState.SUSPECT:
            e = self.table.entries[target.peer_id]
            extra.append(e.claim)
            if e.accusation is not None:
                extra.append(e.accusation)
        return self._piggyback(*extra)

    def _send(self, to: Member | bytes, msg: SwimMessage) -> Send:
        if isinstance(to, Member):
            return Send(to.peer_id, to.address, msg)
        return Send(to, self.address_of(to), msg)

    def _push_pull(self, to: bytes, address, reply: bool, extra: tuple[Update, ...] = ()) -> list[Send]:
        """Our full state to `to`, in pages of at most max_push_pull_bytes; only the first asks
        for a reply."""
        budget = self.config.max_push_pull_bytes
        pages: list[list[Update]] = [[]]
        size = 0
        for u in list(extra) + self.table.updates(self.me_id):
            if pages[-1] and (size + u.wire_size > budget or len(pages[-1]) >= MAX_PUSH_PULL_UPDATES):
                pages.append([])
                size = 0
            pages[-1].append(u)
            size += u.wire_size
        return [Send(to, address, PushPull(tuple(p), reply=reply and i == 0)) for i, p in enumerate(pages)]

    # ---- our own claims

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

    def add_seed(self, peer_id: bytes, address: tuple[str, int], now: float) -> list[Send]:
        """A peer reached through a bootstrap address: push-pull with it. Its reply (its own
        claim first) brings us the swarm: it may introduce a whole table of members, once."""
        if peer_id == self.me_id:
            return []
        self.admission.grant(peer_id, self.config.max_members, now)
        self._seeds[peer_id] = (address, _SEED_TRIES)
        return self._push_pull(peer_id, address, reply=True)

    def _retry_seeds(self, now: float, out: list[Send]) -> None:
        """Push-pull again, once per probe interval, with seeds whose claim has not come back
        (the exchange was lost)."""
        for pid, (address, tries) in list(self._seeds.items()):
            if pid in self.table.entries or tries <= 0:
                del self._seeds[pid]
                continue
            self._seeds[pid] = (address, tries - 1)
            out.extend(self._push_pull(pid, address, reply=True))

    def leave(self, now: float) -> list[Send]:
        """Announce a graceful leave; gossip it at once to a few members."""
        if self.leaving:
            return []
        self.leaving = True
        me = self.me
        self._claim_me(self._sign(me.incarnation, MemberState.LEFT, me.host, me.port, me.region), now)
        return self._gossip_round(now)

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
             announce: Update) -> None:
        pid = claim.peer_id
        old = self.table.set(claim, acc, state, now)
        new = self.table.members[pid]
        if old is None or old.state != state:
            self._changes.append(new)
            logger.debug("member %s: %s -> %s (inc %d)", new.short_id,
                         old.state.name if old else "-", state.name, new.incarnation)
        if old is None and pid != self.me_id:
            self._pool = None
            pos = self._rng.randint(self._probe_index, len(self._probe_order))
            self._probe_order.insert(pos, pid)
        if state != MemberState.SUSPECT:
            self.suspicions.pop(pid, None)
        self.broadcasts.queue(announce)

    def _apply(self, u: Update, src: bytes, now: float) -> None:
        if isinstance(u, Claim):
            self._apply_claim(u, src, now)
        else:
            self._apply_accusation(u, src, now)

    def _apply_claim(self, c: Claim, src: bytes, now: float) -> None:
        pid = c.peer_id
        if pid == self.me_id:
            self._claim_about_me(c, src, now)
            return
        e = self.table.get(pid)
        if e is not None:
            if c == e.claim or c.key() <= e.claim.key():
                return  # held already, or older
            if c.incarnation - e.claim.incarnation > self.config.max_incarnation_jump:
                return self._refuse(c, src, "incarnation jump too large")
        else:
            t = self.table.tombstone(pid)
            if t is not None and c.key() <= t.key():
                return self._refuse(c, src, "not newer than the claim of a removed member")
            if len(self.table) >= self.config.max_members:
                return self._refuse(c, src, "member table full")
            if src != pid and not self.admission.allow(src, now):
                return self._refuse(c, src, "source over its rate of new members")
        if not self.verifier.verify(c):
            return self._refuse(c, src, "bad signature")
        if e is None and src != pid:
            self.admission.take(src, now)
        if e is not None and c.incarnation == e.claim.incarnation and c.state == MemberState.ALIVE:
            self._set(c, e.accusation, e.state, now, announce=c)  # an accusation of it stands
        else:
            self._set(c, None, c.state, now, announce=c)

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

    # ---- messages

    def handle(self, src: bytes, msg: SwimMessage, now: float) -> list[Send]:
        """Feed one received message; src is the authenticated sender."""
        if isinstance(msg, Nack):
            p = self._probe
            if p is not None and p.seq == msg.seq:
                p.nacks += 1
            return []
        for u in msg.updates:
            self._apply(u, src, now)
        if isinstance(msg, PushPull):
            back = self._tombstone_of(src)
            if msg.reply:
                return self._push_pull(src, self.address_of(src), reply=False, extra=back)
            return [Send(src, None, Gossip(back))] if back else []
        if isinstance(msg, Ping):
            if msg.target != self.me_id or self.leaving:
                return []
            return [self._send(src, Ack(msg.seq, self._direct()))]
        if isinstance(msg, Ack):
            return self._on_ack(msg, now)
        if isinstance(msg, PingReq):
            target = self.table.members.get(msg.target)
            if target is None or target.state.gone or msg.target == self.me_id:
                return []  # we probe only members we know, at the address they claimed
            seq = self._next_seq()
            t = self.config.probe_timeout_s
            self._relays[seq] = _Relay(src, msg.seq, now + 0.8 * t, now + t)
            return [self._send(target, Ping(seq, target.peer_id, self._piggyback()))]
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
            self._retry_seeds(now, out)
        if now >= self.next_gossip:
            if len(self.broadcasts):
                out.extend(self._gossip_round(now))
            self.next_gossip = now + self.config.gossip_interval_s
        if now >= self.next_push_pull:
            self.next_push_pull = now + self.config.push_pull_scaled_s(self.live_count())
            target = self._random_members(1, exclude=())
            if target:
                out.extend(self._push_pull(target[0].peer_id, target[0].address, reply=True))
        self._reap(now)
        return out

    def _reap(self, now: float) -> None:
        cfg = self.config
        for pid in self.table.reap(now, cfg.reap_after_s):
            self._pool = None
            self.suspicions.pop(pid, None)
            logger.debug("member %s: removed, gone for %g s", pid[:4].hex(), cfg.reap_after_s)
        self.table.expire_tombstones(now, cfg.tombstone_s, cfg.max_members)

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
            e = self.table.get(pid)
            if e is not None and e.state == MemberState.SUSPECT:
                logger.info("member %s: suspicion timed out, marking dead", e.member.short_id)
                a = self._accuse(pid, e.claim.incarnation, MemberState.DEAD)
                self._set(e.claim, a, MemberState.DEAD, now, announce=a)

    def _tick_probe(self, now: float, out: list[Send]) -> None:
        p = self._probe
        if p is None or p.acked or p.indirect_sent or now < p.timeout_at:
            return
        p.indirect_sent = True
        relays = self._random_members(self.config.indirect_checks, exclude=(p.target.peer_id,))
        p.nacks_expected = len(relays)
        for m in relays:
            out.append(self._send(m, PingReq(p.seq, p.target.peer_id, self._piggyback())))
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
        self._apply_accusation(self._accuse(cur.peer_id, cur.incarnation, MemberState.SUSPECT), self.me_id, now)

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
                self._probe_order = [pid for pid in self._probe_order if pid in self.members
                                     and not self.members[pid].state.gone]
                self._rng.shuffle(self._probe_order)
                self._probe_index = 0
                if not self._probe_order:
                    return None
            pid = self._probe_order[self._probe_index]
            self._probe_index += 1
            m = self.members.get(pid)
            if m is not None and not m.state.gone:
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
        entries = self.table.entries
        targets = [entries[p].member for p in cands if not entries[p].state.gone
                   or now - entries[p].changed_at < self.config.gossip_to_dead_s][:k]
        out = []
        for m in targets:
            ups = self._piggyback()
            if not ups:
                break
            out.append(self._send(m, Gossip(ups)))
        return out
