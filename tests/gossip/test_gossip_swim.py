"""Table tests of the sans-IO SWIM state machine: exact virtual times, no I/O."""

import random

import pytest

from dtfm.gossip.broadcast import BroadcastQueue
from dtfm.gossip.claims import Accusation, Claim
from dtfm.gossip.config import GossipConfig
from dtfm.gossip.members import Member, MemberState
from dtfm.gossip.messages import Ack, Gossip, Nack, Ping, PingReq, PushPull
from dtfm.gossip.swim import Swim
from dtfm.net import Identity
from verifying import answer_verifications

CFG = GossipConfig.lan()
KEYS = {i.peer_id: i for i in (Identity(bytes([k + 1]) * 32) for k in range(24))}
PIDS = list(KEYS)
A, B, C, D = PIDS[:4]


def host(pid):
    return "10.0.0.%d" % (PIDS.index(pid) + 1)


def member(pid, inc=0, state=MemberState.ALIVE):
    return Member(pid, inc, state, host(pid), 7000, "r")


def claim(pid, inc=0, state=MemberState.ALIVE):
    return Claim.create(KEYS[pid], inc, state, host(pid), 7000, "r")


def accuse(by, of, inc=0, state=MemberState.SUSPECT):
    return Accusation.create(KEYS[by], of, inc, state)


def node_with(pid, others, now=0.0):
    s = Swim(CFG, KEYS[pid], member(pid), random.Random(1), now)
    for o in others:
        answer_verifications(s, s.handle(o, PushPull((claim(o),), reply=False), now), now)
    s.drain_changes()
    s.broadcasts = BroadcastQueue()  # start quiet: only the events under test are gossiped
    return s


def run_to(s, t):
    out = []
    while s.next_deadline() <= t:
        now = s.next_deadline()
        out += [(now, x) for x in s.tick(now)]
    return out


def test_probe_then_indirect_then_suspect_at_exact_times():
    s = node_with(A, [B, C, D])
    t0 = s.next_probe
    sends = s.tick(t0)
    pings = [x for x in sends if isinstance(x.msg, Ping)]
    assert len(pings) == 1
    target = pings[0].to
    # no ack: at t0 + probe timeout, ping-req to the other two members
    assert s.next_deadline() == t0 + CFG.probe_timeout_s
    sends = s.tick(t0 + CFG.probe_timeout_s)
    reqs = [x for x in sends if isinstance(x.msg, PingReq)]
    assert sorted(x.to for x in reqs) == sorted(set([B, C, D]) - {target})
    assert all(x.msg.target == target for x in reqs)
    # still nothing by the end of the probe interval: suspect
    s.tick(t0 + CFG.probe_interval_s)
    assert s.members[target].state == MemberState.SUSPECT
    assert [m.state for m in s.drain_changes()] == [MemberState.SUSPECT]
    # 4 members wait for k = 2 confirmations; none come: dead after the maximum suspicion time
    susp_at = t0 + CFG.probe_interval_s
    deadline = susp_at + CFG.suspicion_max_s(4)
    assert s.suspicions[target].deadline == pytest.approx(deadline, abs=1e-3)
    run_to(s, deadline - 0.01)
    assert s.members[target].state == MemberState.SUSPECT
    run_to(s, deadline)
    assert s.members[target].state == MemberState.DEAD


def test_ack_prevents_suspicion_and_relays_answer():
    s = node_with(A, [B, C])
    t0 = s.next_probe
    ping = [x for x in s.tick(t0) if isinstance(x.msg, Ping)][0]
    s.handle(ping.to, Ack(ping.msg.seq), t0 + 0.01)
    run_to(s, t0 + CFG.probe_interval_s)
    assert all(m.state == MemberState.ALIVE for m in s.members.values())
    assert s.awareness == 0


def test_indirect_probe_relay_acks_or_nacks():
    s = node_with(B, [A, C])
    out = s.handle(A, PingReq(7, C), 10.0)
    assert len(out) == 1 and out[0].to == C and isinstance(out[0].msg, Ping)
    relay_seq = out[0].msg.seq
    back = s.handle(C, Ack(relay_seq), 10.1)
    assert [(x.to, x.msg) for x in back] == [(A, Ack(7))]
    # a second request that the target never answers: a nack at 80% of the probe timeout
    out = s.handle(A, PingReq(8, C), 20.0)
    nacks = [x for x in run_to(s, 20.0 + CFG.probe_timeout_s) if isinstance(x[1].msg, Nack)]
    assert nacks == [(20.0 + 0.8 * CFG.probe_timeout_s, nacks[0][1])]
    assert nacks[0][1].to == A and nacks[0][1].msg.seq == 8


def test_ping_answered_with_ack_and_misdirected_ping_ignored():
    s = node_with(A, [B])
    assert [x.msg.seq for x in s.handle(B, Ping(5, A), 1.0)] == [5]
    assert s.handle(B, Ping(6, C), 1.0) == []


def test_refutes_suspicion_with_higher_incarnation():
    s = node_with(A, [B])
    s.handle(B, Gossip((accuse(B, A, 0),)), 1.0)
    assert s.me.incarnation == 1 and s.me.state == MemberState.ALIVE
    assert s.awareness == 1
    pending = s.broadcasts.pending()
    assert any(isinstance(u, Claim) and u.peer_id == A and u.incarnation == 1 for u in pending)
    # an accusation of an incarnation we never claimed changes nothing
    s.handle(B, Gossip((accuse(B, A, 5, MemberState.DEAD),)), 2.0)
    assert s.me.incarnation == 1
    # our own claim of an earlier life at a higher incarnation (we were restarted): refute above it
    s.handle(B, Gossip((claim(A, 5),)), 2.0)
    assert s.me.incarnation == 6 and s.me.state == MemberState.ALIVE


def test_confirmations_shorten_suspicion():
    others = PIDS[10:20]
    s = node_with(A, others)
    x = others[0]
    s.handle(others[1], Gossip((accuse(others[1], x),)), 0.0)
    n = s.live_count()
    assert s.suspicions[x].deadline == pytest.approx(CFG.suspicion_max_s(n), abs=1e-3)
    s.handle(others[2], Gossip((accuse(others[2], x),)), 1.0)
    s.handle(others[3], Gossip((accuse(others[3], x, 0, MemberState.DEAD),)), 1.0)  # dead: one more confirmation
    assert s.members[x].state == MemberState.SUSPECT
    assert s.suspicions[x].deadline == pytest.approx(CFG.suspicion_min_s(n), abs=1e-3)  # k = 2 confirmations reached
    # the suspect refutes: suspicion cancelled
    s.handle(x, Gossip((claim(x, 1),)), 2.0)
    assert x not in s.suspicions and s.members[x].state == MemberState.ALIVE


def test_leave_is_gossiped_and_stops_probing():
    s = node_with(A, [B, C])
    sends = s.leave(5.0)
    assert sends and all(isinstance(x.msg, Gossip) for x in sends)
    assert any(isinstance(u, Claim) and u.state == MemberState.LEFT for x in sends for u in x.msg.updates)
    assert not [x for x in run_to(s, 20.0) if isinstance(x[1].msg, Ping)]
    other = node_with(B, [A, C])
    other.handle(A, sends[0].msg, 5.1)
    assert other.members[A].state == MemberState.LEFT
    assert other.live_count() == 2


def test_push_pull_merges_and_replies_once():
    s = node_with(A, [])
    out = s.handle(B, PushPull((claim(B), claim(C, 2)), reply=True), 0.0)
    assert s.members[C].incarnation == 2 and len(s.members) == 3
    assert s.live_count() == 1  # B and C count once they answer at their addresses
    verifying = sorted((x.to, x.address) for x in out if x.dial)
    assert verifying == sorted([(B, (host(B), 7000)), (C, (host(C), 7000))])
    [reply] = answer_verifications(s, out, 0.0)
    assert s.live_count() == 3
    # the reply went out before B and C answered: it vouches for nobody unverified
    assert reply.msg.reply is False and reply.msg.updates == (s.table.entries[A].claim,)
    assert s.handle(B, PushPull((claim(B),), reply=False), 0.0) == []
    [reply] = s.handle(B, PushPull((claim(B),), reply=True), 0.0)
    assert len(reply.msg.updates) == 3


def test_a_member_that_claims_no_address_yet_is_not_probed_and_its_new_address_reaches_everyone():
    # A daemon listening on a wildcard claims ("", 0) until peers confirm the address they see;
    # members that learnt that claim cannot ping it, so they must not suspect it (they did, and
    # declared it dead), and once it claims its address it tells them directly: they do not
    # confirm it, so they would never gossip with it otherwise.
    s = node_with(A, [C])
    nowhere = Claim.create(KEYS[B], 0, MemberState.ALIVE, "", 0, "r")
    s.handle(C, Gossip((nowhere,)), 0.0)
    assert B in s.members and not s.is_confirmed(B)
    out = run_to(s, 30.0)
    assert not [x for _, x in out if x.to == B]  # never pinged, verified or dialled
    assert s.members[B].state == MemberState.ALIVE

    b = Swim(CFG, KEYS[B], Member(B, 0, MemberState.ALIVE, "", 0, "r"), random.Random(2), 0.0)
    b.handle(A, PushPull((claim(A),), reply=False), 0.0)
    sends = b.advertise_address(host(B), 7000, 1.0)
    assert [(x.to, x.address) for x in sends] == [(A, (host(A), 7000))]
    assert b.advertise_address(host(B), 7000, 2.0) == []  # unchanged: nothing to tell
    told = s.handle(B, sends[0].msg, 31.0)
    assert s.members[B].address == (host(B), 7000)
    verify = [x for x in told + s.tick(31.0) if x.to == B and x.dial]
    assert verify and verify[0].address == (host(B), 7000)
    answer_verifications(s, verify, 31.0)
    assert s.is_confirmed(B)
