"""SWIM failure detector and membership with Lifeguard, as a sans-IO state machine.

`Swim` does no I/O and reads no clock: the caller passes `now`, feeds it received messages
with `handle(src, msg, now)`, calls `tick(now)` at `next_deadline()`, and sends the `Send`s both
return. The same machine runs over the real transport (GossipService) and over the in-memory
harness under MockClock.

The membership rules (what a signed claim or accusation does to the table) live in
`membership.py`, which `Swim` extends with SWIM's probes, Lifeguard's local health and
buddy system, dissemination by piggyback and gossip rounds, and paged push-pull.

Verification: a member enters the table unconfirmed and counts as alive only once it has
acked a verification ping, a `Ping` whose `seq` is a random nonce, sent as a `Send` with
`dial=True`: the caller delivers it only over a connection it dialled to the member's claimed
address and whose handshake proved the member's identity. So a fake member, claimed at an
address where nobody holding its key listens, never counts (it cannot learn the nonce to
ack). Gossip rounds, push-pulls, indirect probes and relayed probes go to confirmed members
only; unconfirmed ones get our verification pings and their turn of the regular probes.

A verification is not given up on a slow answer: an ack that comes after its ping's deadline
still confirms (a nonce stays answerable for LATE_ACK_FACTOR deadlines more; a loaded host, or
a ping queued behind a bandwidth probe on a slow link, answers in seconds), and a member whose
attempts all went unanswered is queued again after a back-off that doubles up to
MAX_VERIFY_BACKOFF_S. A fake member claimed at an address where nobody answers costs a dial per
back-off until the regular probes find it dead.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .admission import address_group
from .claims import ClaimVerifier, Update
from .config import GossipConfig
from .members import Member, MemberState
from .membership import Membership
from .messages import MAX_PUSH_PULL_UPDATES, Ack, Gossip, Nack, Ping, PingReq, PushPull, SwimMessage

if TYPE_CHECKING:
    from dtfm.net import Identity

__all__ = ["Swim", "Send"]

logger = logging.getLogger(__name__)

_SEED_TRIES = 10  # push-pulls with a seed, one per probe interval, until its claim arrives
_PAGE_OVERHEAD = 64  # bytes of a push-pull page besides its updates
MAX_ADDRESS_PUSH = 64  # members told a new address of ours directly (the others learn it by gossip)
LATE_ACK_FACTOR = 4  # a verification nonce stays answerable this many verify_timeout_s past its deadline
MAX_LATE_NONCES = 1024  # expired verification nonces kept answerable (the oldest go first)
MAX_VERIFY_BACKOFF_S = 300.0  # the longest wait before a member that never answered is verified again


@dataclass(frozen=True)
class Send:
    to: bytes
    address: tuple[str, int] | None  # where to connect if there is no connection yet
    msg: SwimMessage
    # True: send only over a connection dialled to `address` whose handshake proved `to`
    # (a reused one must have been dialled there too), else drop it (a verification ping)
    dial: bool = False


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
    relays: frozenset[bytes] = frozenset()  # asked to probe it: their acks count too
    dial: bool = False  # an unconfirmed target: a nonce seq, sent over a dialled connection


@dataclass
class _Verify:
    peer_id: bytes
    address: tuple[str, int]
    deadline: float
    group: str | None = None  # the address group it is queued under


@dataclass
class _Relay:
    requester: bytes
    orig_seq: int
    nack_at: float
    expire_at: float
    nacked: bool = False


class Swim(Membership):
    """nonces: where verification nonces come from (default: rng). A caller facing real
    peers passes an unpredictable source (`random.SystemRandom()`)."""

    def __init__(self, config: GossipConfig, identity: Identity, me: Member, rng: random.Random, now: float, *,
                 verifier: ClaimVerifier | None = None, nonces: random.Random | None = None) -> None:
        # Unconfirmed members waiting for a verification ping, queued per address group their
        # claim came from (member -> attempts left, oldest first), served in turn so that one
        # party's flood delays the others' members by a turn per group, not per member.
        self._verify_queues: dict[str | None, dict[bytes, int]] = {}
        self._queued_in: dict[bytes, str | None] = {}  # member -> the group it is queued under
        self._verify_turn = 0  # the group served first next time (round robin)
        self._verifying: dict[int, _Verify] = {}  # nonce -> verification in flight
        # nonce -> a verification (or a probe of an unconfirmed member) past its deadline whose
        # ack still confirms, oldest first; its deadline: until when
        self._late: OrderedDict[int, _Verify] = OrderedDict()
        # members whose attempts all went unanswered: member -> (when to queue them again,
        # back-offs so far, their group); _next_unpark: the earliest of those times
        self._parked: dict[bytes, tuple[float, int, str | None]] = {}
        self._next_unpark = float("inf")
        super().__init__(config, identity, me, now, verifier=verifier)
        self._rng = rng
        self._nonces = nonces if nonces is not None else rng
        self._seq = 0
        self._probe_order: list[bytes] = []
        self._probe_index = 0
        self._probe: _Probe | None = None
        self._relays: dict[int, _Relay] = {}
        self._pool: list[bytes] | None = None  # every other member in the table, for gossip targets
        self._seeds: dict[bytes, tuple[tuple[str, int], int]] = {}  # seed -> (address, tries left)
        self.next_probe = now + rng.uniform(0, config.probe_interval_s)
        self.next_gossip = now + rng.uniform(0, config.gossip_interval_s)
        pp = config.push_pull_interval_s
        self.next_push_pull = now + rng.uniform(0, pp) if pp > 0 else float("inf")

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
        for v in self._verifying.values():
            t = min(t, v.deadline)
        return min(t, self._next_unpark)

    def _multiplier(self) -> int:
        return self.awareness + 1

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

    def _push_pull(self, to: bytes, address: tuple[str, int] | None, reply: bool, extra: tuple[Update, ...] = ()) -> list[Send]:
        """Our full state to `to`, in pages of at most max_push_pull_bytes; only the first asks
        for a reply."""
        budget = self.config.max_push_pull_bytes - _PAGE_OVERHEAD
        pages: list[list[Update]] = [[]]
        size = 0
        for u in list(extra) + self.table.updates(self.me_id):
            if pages[-1] and (size + u.wire_size > budget or len(pages[-1]) >= MAX_PUSH_PULL_UPDATES):
                pages.append([])
                size = 0
            pages[-1].append(u)
            size += u.wire_size
        return [Send(to, address, PushPull(tuple(p), reply=reply and i == 0)) for i, p in enumerate(pages)]

    def _on_new_member(self, peer_id: bytes) -> None:
        pos = self._rng.randint(self._probe_index, len(self._probe_order))
        self._probe_order.insert(pos, peer_id)

    def _on_confirmed(self, peer_id: bytes) -> None:
        self._pool = None
        self._dequeue(peer_id)
        self._parked.pop(peer_id, None)

    def _on_unconfirmed_address(self, peer_id: bytes, group: str | None) -> None:
        self._dequeue(peer_id)
        self._parked.pop(peer_id, None)
        m = self.table.members[peer_id]
        if m.host and m.port:  # else nothing to dial until it claims an address
            self._enqueue(peer_id, self.config.verify_attempts, group)  # (again) at the back

    def _on_removed(self, peer_id: bytes) -> None:
        self._pool = None
        self._dequeue(peer_id)
        self._parked.pop(peer_id, None)

    def _enqueue(self, peer_id: bytes, attempts: int, group: str | None) -> None:
        self._verify_queues.setdefault(group, {})[peer_id] = attempts
        self._queued_in[peer_id] = group

    def _dequeue(self, peer_id: bytes) -> tuple[int, str | None]:
        """(attempts left, group) of a queued member, removed from its queue; (0, None) if none."""
        if peer_id not in self._queued_in:
            return 0, None
        group = self._queued_in.pop(peer_id)
        queue = self._verify_queues[group]
        left = queue.pop(peer_id)
        if not queue:
            del self._verify_queues[group]
        return left, group

    # ---- verification

    def _verify(self, now: float, out: list[Send]) -> None:
        """Expire verifications past their deadline (the member goes to the back of the queue
        while it has attempts left) and start queued ones while fewer than max_verifying are
        in flight."""
        cfg = self.config
        for nonce, v in list(self._verifying.items()):
            if now >= v.deadline:
                del self._verifying[nonce]
                self._keep_late(nonce, v)
                left, queued_in = self._dequeue(v.peer_id)
                group = queued_in if left else v.group
                logger.debug("member %s: no answer to verification at %s:%d within %g s (%d attempts left)",
                             v.peer_id[:4].hex(), *v.address, cfg.verify_timeout_s, left)
                if v.peer_id not in self.table.entries or self.is_confirmed(v.peer_id):
                    continue
                if left > 0:
                    self._enqueue(v.peer_id, left, group)
                elif v.peer_id not in self._queued_in:
                    self._park(v.peer_id, group, now)
        while self._late and next(iter(self._late.values())).deadline <= now:
            self._late.popitem(last=False)
        if now >= self._next_unpark:
            self._unpark(now)
        if len(self._verifying) >= cfg.max_verifying or not self._verify_queues:
            return
        busy = {v.peer_id for v in self._verifying.values()}
        groups = list(self._verify_queues)
        start = self._verify_turn % len(groups)
        order = groups[start:] + groups[:start]
        served = 0
        progress = True
        while progress and len(self._verifying) < cfg.max_verifying:
            progress = False  # one member of each group per pass
            for group in order:
                if len(self._verifying) >= cfg.max_verifying:
                    break
                pid = self._next_to_verify(group, busy)
                if pid is None:
                    continue
                progress = True
                served += 1
                busy.add(pid)
                m = self.table.members[pid]
                left, _ = self._dequeue(pid)
                if left > 1:
                    self._enqueue(pid, left - 1, group)  # to the back, for a later attempt
                nonce = self._nonce()
                self._verifying[nonce] = _Verify(pid, m.address, now + cfg.verify_timeout_s, group)
                logger.debug("member %s: verifying at %s:%d", m.short_id, m.host, m.port)
                mine = self.table.entries[self.me_id].claim  # (no broadcasts: it may be a fake)
                out.append(Send(pid, m.address, Ping(nonce, pid, (mine,)), dial=True))
        self._verify_turn = start + served

    def _keep_late(self, nonce: int, v: _Verify) -> None:
        """Keep an expired verification's nonce answerable for LATE_ACK_FACTOR deadlines more."""
        late = v.deadline + LATE_ACK_FACTOR * self.config.verify_timeout_s
        self._late[nonce] = _Verify(v.peer_id, v.address, late)
        self._late.move_to_end(nonce)
        if len(self._late) > MAX_LATE_NONCES:
            self._late.popitem(last=False)

    def _park(self, peer_id: bytes, group: str | None, now: float) -> None:
        """A member whose attempts all went unanswered: verify it again after a back-off
        (attempts x timeout, doubling each time, at most MAX_VERIFY_BACKOFF_S)."""
        cfg = self.config
        _, rounds, _ = self._parked.get(peer_id, (0.0, 0, group))
        wait = min(MAX_VERIFY_BACKOFF_S, cfg.verify_attempts * cfg.verify_timeout_s * 2 ** min(rounds, 16))
        self._parked[peer_id] = (now + wait, rounds + 1, group)
        self._next_unpark = min(self._next_unpark, now + wait)
        logger.debug("member %s: unverified after %d attempts; again in %g s", peer_id[:4].hex(),
                     cfg.verify_attempts, wait)

    def _unpark(self, now: float) -> None:
        """Queue again the parked members whose back-off is over (they keep their count of
        back-offs until confirmed or removed)."""
        nxt = float("inf")
        for pid, (at, rounds, group) in self._parked.items():
            if at > now:
                nxt = min(nxt, at)
            elif pid not in self._queued_in and not any(v.peer_id == pid for v in self._verifying.values()):
                self._parked[pid] = (float("inf"), rounds, group)
                self._enqueue(pid, self.config.verify_attempts, group)
        self._next_unpark = nxt

    def _next_to_verify(self, group: str | None, busy: set[bytes]) -> bytes | None:
        """The first member of group's queue that can be pinged now (dropping the ones gone
        from the table or confirmed); None if none can."""
        queue = self._verify_queues.get(group)
        for pid in list(queue or ()):
            m = self.table.members.get(pid)
            if m is None or self.is_confirmed(pid):
                self._dequeue(pid)
                continue
            if pid in busy or m.state.gone:
                continue  # in flight, or suspected dead by now: stays queued
            return pid
        return None

    def _nonce(self) -> int:
        """A seq nobody can guess, distinct from those in flight."""
        while True:
            nonce = self._nonces.getrandbits(63)
            if nonce not in self._verifying and nonce not in self._relays and nonce not in self._late:
                return nonce

    def _on_verify_ack(self, v: _Verify, now: float) -> None:
        m = self.table.members.get(v.peer_id)
        if m is None or self.is_confirmed(v.peer_id):
            return
        if m.address != v.address:  # it claims another address since: verify that one
            _, group = self._dequeue(v.peer_id)
            self._on_unconfirmed_address(v.peer_id, group)
            return
        self._confirm(v.peer_id, now)

    # ---- joining and leaving

    def advertise_address(self, host: str, port: int, now: float) -> list[Send]:
        """Advertise host:port from now on (a new claim one incarnation up) and tell it at once
        to up to MAX_ADDRESS_PUSH members, over a connection we hold or at their address: a
        member that holds our old claim (none yet, before peers confirmed an address) cannot
        confirm us and so never gossips with us, and would not learn the new one otherwise."""
        before = self.me.incarnation
        self.set_address(host, port, now)
        if self.me.incarnation == before:
            return []
        mine = self.table.entries[self.me_id].claim
        others = [m for m in self.members.values() if m.peer_id != self.me_id and not m.state.gone]
        others = self._rng.sample(others, min(MAX_ADDRESS_PUSH, len(others)))
        return [Send(m.peer_id, m.address if m.host and m.port else None, Gossip((mine,))) for m in others]

    def add_seed(self, peer_id: bytes, address: tuple[str, int], now: float, *,
                 origin: str | None = None) -> list[Send]:
        """A peer reached through a bootstrap address: push-pull with it. Its reply (its own
        claim first) brings us the swarm: it may introduce a whole table of members while we
        join (for as long as we retry it), then only as many as any other source. origin:
        the host of the connection to it (whose address group gets the same allowance)."""
        if peer_id == self.me_id:
            return []
        grant_s = _SEED_TRIES * self.config.probe_interval_s
        self.admission.grant(peer_id, self.config.max_members, now, grant_s)
        if origin is not None:
            self.address_admission.grant(address_group(origin), self.config.max_members, now, grant_s)
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

    # ---- messages

    def handle(self, src: bytes, msg: SwimMessage, now: float, *, origin: str | None = None) -> list[Send]:
        """Feed one received message; src is the authenticated sender, origin the remote host
        of the connection it came over (new members are admitted per its address group; None:
        not known, only the per-source limit applies)."""
        out = self._handle(src, msg, now, None if origin is None else address_group(origin))
        self._verify(now, out)
        return out

    def _handle(self, src: bytes, msg: SwimMessage, now: float, group: str | None) -> list[Send]:
        if isinstance(msg, Nack):
            p = self._probe
            if p is not None and p.seq == msg.seq:
                p.nacks += 1
            return []
        for u in msg.updates:
            self._apply(u, src, now, group)
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
            return self._on_ack(src, msg, now)
        if isinstance(msg, PingReq):
            target = self.table.members.get(msg.target)
            if target is None or target.state.gone or msg.target == self.me_id or not self.is_confirmed(msg.target):
                return []  # we probe only confirmed members, at the address they claimed
            seq = self._next_seq()
            t = self.config.probe_timeout_s
            self._relays[seq] = _Relay(src, msg.seq, now + 0.8 * t, now + t)
            return [self._send(target, Ping(seq, target.peer_id, self._piggyback()))]
        return []  # Gossip: updates applied above

    def _on_ack(self, src: bytes, msg: Ack, now: float) -> list[Send]:
        v = self._verifying.get(msg.seq)
        if v is not None and v.peer_id == src:
            del self._verifying[msg.seq]
            self._on_verify_ack(v, now)
            return []
        v = self._late.get(msg.seq)
        if v is not None and v.peer_id == src:
            del self._late[msg.seq]
            logger.debug("member %s: verified by a late ack", src[:4].hex())
            self._on_verify_ack(v, now)
            return []
        p = self._probe
        if p is not None and p.seq == msg.seq and not p.acked and (src == p.target.peer_id or src in p.relays):
            p.acked = True
            self._adjust_awareness(-1)
            if p.dial and src == p.target.peer_id:  # a probe of an unconfirmed member verifies it too
                self._on_verify_ack(_Verify(src, p.target.address, p.end_at), now)
            return []
        r = self._relays.pop(msg.seq, None)
        if r is not None:
            return [self._send(r.requester, Ack(r.orig_seq))]
        logger.debug("ack %d from %s: nothing waits for it (late)", msg.seq, src[:4].hex())
        return []

    # ---- timers

    def tick(self, now: float) -> list[Send]:
        out: list[Send] = []
        self._verify(now, out)
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

    def _tick_relays(self, now: float, out: list[Send]) -> None:
        for seq, r in list(self._relays.items()):
            if now >= r.expire_at:
                del self._relays[seq]
            elif not r.nacked and now >= r.nack_at:
                r.nacked = True
                out.append(self._send(r.requester, Nack(r.orig_seq)))

    def _tick_probe(self, now: float, out: list[Send]) -> None:
        p = self._probe
        if p is None or p.acked or p.indirect_sent or now < p.timeout_at:
            return
        p.indirect_sent = True
        relays = self._random_members(self.config.indirect_checks, exclude=(p.target.peer_id,))
        p.nacks_expected = len(relays)
        p.relays = frozenset(m.peer_id for m in relays)
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
        if p.dial and not self.is_confirmed(p.target.peer_id):  # its own ack, even late, verifies it
            self._keep_late(p.seq, _Verify(p.target.peer_id, p.target.address, p.end_at))
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
        # An unconfirmed member is probed as it is verified: a nonce, over a dialled connection.
        dial = not self.is_confirmed(target.peer_id)
        if dial:
            logger.debug("member %s: probing it unconfirmed, at %s:%d", target.short_id, target.host, target.port)
        seq = self._nonce() if dial else self._next_seq()
        self._probe = _Probe(target, seq, now + self.config.probe_timeout_s * mult,
                             now + self.config.probe_interval_s * mult, dial=dial)
        out.append(Send(target.peer_id, target.address, Ping(seq, target.peer_id, self._direct(target)), dial=dial))

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
            if m is not None and not m.state.gone and (m.host and m.port or self.is_confirmed(pid)):
                return m  # (an unconfirmed member that claims no address yet has nowhere to be probed)
        return None

    def _random_members(self, k: int, exclude: Container[bytes]) -> list[Member]:
        confirmed = self.is_confirmed
        pool = [m for m in self.members.values() if m.peer_id != self.me_id and not m.state.gone
                and m.peer_id not in exclude and confirmed(m.peer_id)]
        return self._rng.sample(pool, min(k, len(pool)))

    def _gossip_round(self, now: float) -> list[Send]:
        if not len(self.broadcasts):
            return []
        if self._pool is None:
            self._pool = [pid for pid in self.members if pid != self.me_id and self.is_confirmed(pid)]
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
