"""The coordinator election: each rule as a table, the wire codec, the durable store, the whole
protocol under a rule-based state machine over the simulated network, and the take-over figures."""

from __future__ import annotations

import os
import random
import statistics
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from sim_faults import SimFaults

from dtfm.control.election import (
    MAX_TERM,
    BecameCoordinator,
    Certificate,
    CoordinatorAnswer,
    CoordinatorKnown,
    ElectionConfig,
    ElectionRole,
    ElectionSend,
    ElectionState,
    ElectionStoreError,
    FileElectionStore,
    Heartbeat,
    HeartbeatAck,
    MemoryElectionStore,
    Persist,
    PreVote,
    PreVoteReply,
    PreviousConfiguration,
    RequestVote,
    SteppedDown,
    Vote,
    config_digest,
    decode_election,
    quorum,
    vote_payload,
)
from dtfm.control.election.council import Council, CouncilLink, link_payload
from dtfm.control.election.discovery import explain
from dtfm.control.election.state import trusted_root
from dtfm.control.testing.election_sim import ElectionSim, NetConditions, returning_peer, takeover_times
from dtfm.control.testing.sim import PlaneSim
from dtfm.net import Identity, ProtocolError, pack, short_id, unpack_untrusted, verify_signature
from examples import examples

# Real Ed25519 keys (votes are signatures): A < B < ... < E by peer id; X and Y are outsiders.
KEYS = sorted((Identity(bytes([i]) * 32) for i in range(1, 8)), key=lambda k: k.peer_id)
SIGNERS = {k.peer_id: k for k in KEYS}
A, B, C, D, E, X, Y = (k.peer_id for k in KEYS)
FIVE = (A, B, C, D, E)
CFG = ElectionConfig.test()
PLAIN = CFG.with_(pre_vote=False, check_quorum=False)
HUGE = 2**63 - 1


def node(me=B, voters=FIVE, config=CFG, rng=None, **kw) -> ElectionState:
    return ElectionState(me, config, rng or random.Random(0), 0.0, signer=SIGNERS[me], voters=voters, **kw)


def council(voters=FIVE) -> Council:
    """A council of `voters` taken on trust (the operator's root is the plane's to check)."""
    return trusted_root(tuple(voters))


def changed(before: Council, after, by_cert: Certificate) -> Council:
    """`before` with one change to `after`, signed by the coordinator `by_cert` elects over it."""
    after = tuple(sorted(after))
    epoch = before.links[-1].epoch + 1 if before.links and before.links[-1].term == by_cert.term else 1
    sig = SIGNERS[by_cert.candidate].sign(link_payload(by_cert.term, epoch, before.voters, after))
    return before.extended(CouncilLink(by_cert, after, sig, epoch))


def sends(actions, kind=None):
    return [a for a in actions if isinstance(a, ElectionSend) and (kind is None or isinstance(a.msg, kind))]


def vote(voter, term, candidate, voters=FIVE) -> Vote:
    """`voter`'s granted vote for `candidate` in `term`, signed over the configuration `voters`."""
    return Vote(term, True, term, SIGNERS[voter].sign(vote_payload(term, candidate, config_digest(voters))))


def cert(term, candidate, signers, voters=FIVE) -> Certificate:
    """The certificate of `signers`' votes for `candidate` in `term` (a quorum of `voters`)."""
    sigs = {v: SIGNERS[v].sign(vote_payload(term, candidate, config_digest(voters))) for v in signers}
    return Certificate.of(term, candidate, tuple(voters), sigs)


def hb(term, coord, seq=1, applied=(0, 0), signers=None, voters=FIVE) -> Heartbeat:
    """A heartbeat of `coord` in `term`, certified by `signers` (by default it and the next voters, a quorum)."""
    if signers is None:
        at = voters.index(coord)
        signers = tuple(voters[(at + i) % len(voters)] for i in range(quorum(len(voters))))
    return Heartbeat(term, coord, seq, *applied, cert(term, coord, signers, voters))


def request(term, candidate, applied=(0, 0), voters=FIVE) -> RequestVote:
    return RequestVote(term, candidate, *applied, config_digest(voters))


def coordinator(me=A, voters=FIVE, config=CFG) -> ElectionState:
    """`me` elected coordinator of term 1 at t = 0 by B, C and D (with it, a quorum of five)."""
    n = node(me, voters, config)
    n.campaign(0.0)
    if config.pre_vote:
        for v in (B, C, D):
            n.handle(v, PreVoteReply(1, True, 0), 0.0)
    for v in (B, C, D):
        n.handle(v, vote(v, 1, me, voters), 0.0)
    assert n.role is ElectionRole.COORDINATOR
    return n


def follower_of(coord=A, term=1, now=0.0, me=B, **kw) -> ElectionState:
    n = node(me, **kw)
    n.handle(coord, hb(term, coord), now)
    assert n.coordinator == coord
    return n


# ---------------------------------------------------------------------- configuration


@pytest.mark.parametrize("changes", [
    {"election_timeout_min_s": 0.0},
    {"election_timeout_max_s": 0.3},  # not above the minimum
    {"heartbeat_interval_s": 0.2},  # more than a third of the minimum timeout
    {"lease_s": 0.05},  # not above two heartbeats
    {"lease_s": 0.5},  # above the minimum timeout
    {"stagger_s": -1.0},
    {"pre_vote": 1},
    {"heartbeat_interval_s": float("nan")},
])
def test_config_refuses(changes):
    with pytest.raises(ValueError):
        CFG.with_(**changes)


def test_profiles_are_valid_and_ordered():
    for cfg in (ElectionConfig.wan(), ElectionConfig.lan(), ElectionConfig.test()):
        assert cfg.heartbeat_interval_s * 2 < cfg.lease_s <= cfg.election_timeout_min_s
    assert ElectionConfig.test().election_timeout_min_s < ElectionConfig.wan().election_timeout_min_s


def test_quorum_tolerates_one_lying_voter_from_four_voters():
    assert [quorum(n) for n in range(1, 10)] == [1, 2, 2, 3, 4, 4, 5, 5, 6]
    for n in range(1, 40):
        assert quorum(n) > n / 2  # two quorums meet
        if n >= 4:  # ... in two voters, also across configurations one voter apart
            assert 2 * quorum(n) - n >= 2 and quorum(n) + quorum(n + 1) - (n + 1) >= 2
            assert quorum(n) - 1 < n / 2 + 1  # the smallest such count


# ---------------------------------------------------------------------- votes


def test_vote_once_per_term_persisted_before_sent_and_signed():
    n = node(B)
    out = n.handle(A, request(1, A), 0.0)
    assert out == [Persist(1, A), ElectionSend(A, vote(B, 1, A))]  # Ed25519 is deterministic
    assert n.handle(C, request(1, C), 0.01) == [ElectionSend(C, Vote(1, False, 1, b""))]
    # a duplicated request gets the same answer without a second write
    assert n.handle(A, request(1, A), 0.02) == [ElectionSend(A, vote(B, 1, A))]
    # the next term is a fresh vote, persisted before it is sent
    out = n.handle(C, request(2, C), 0.03)
    assert [a for a in out if not isinstance(a, CoordinatorKnown)] == [Persist(2, C), ElectionSend(C, vote(B, 2, C))]


@pytest.mark.parametrize("request_, voter_kw, granted", [
    (request(1, A), {}, True),
    (request(1, A, (3, 1)), {"applied": (3, 2)}, False),  # candidate's applied (term, epoch) is older
    (request(4, A, (3, 1)), {"applied": (2, 9)}, True),  # newer term beats a larger epoch
    (request(1, A), {"term": 2}, False),  # stale term
    (request(2, A), {"term": 2, "voted_for": C}, False),  # voted in this term already (reloaded)
    (request(2, A), {"term": 2, "voted_for": A}, True),
    (request(3, A, (3, 1), voters=(A, B, C)), {"applied": (3, 1)}, False),  # same allocation, other configuration
    (request(3, A, (3, 2), voters=(A, B, C)), {"applied": (3, 1)}, True),  # a newer one: its own configuration
    (request(CFG.max_term_jump, A), {}, True),  # the largest jump a vote takes (from term 0)
    (request(CFG.max_term_jump + 1, A), {}, False),  # one more
])
def test_vote_rules(request_, voter_kw, granted):
    n = node(B, **{"voters": FIVE, **voter_kw})
    term = n.term
    out = n.handle(A, request_, 0.0)
    votes = sends(out, Vote)
    assert [v.msg.granted for v in votes] == [granted]
    assert n.term == (request_.term if granted else term)  # a refused request moves no term
    persists = [a for a in out if isinstance(a, Persist)]
    if granted and "voted_for" not in voter_kw:
        assert out.index(persists[-1]) < out.index(votes[0]) and persists[-1].voted_for == A
    elif granted:  # the vote was persisted before the restart: granted again, not written again
        assert persists == []


def test_a_candidate_votes_for_itself_persisted_before_its_requests():
    n = node(A, config=PLAIN)
    out = n.tick(1.0)
    assert out[0] == Persist(1, A) and n.role is ElectionRole.CANDIDATE
    assert {s.to for s in sends(out, RequestVote)} == {B, C, D, E}
    assert sends(out, RequestVote)[0].msg.config == config_digest(FIVE)


def test_pre_vote_changes_nothing_and_leads_to_a_persisted_candidacy():
    n = node(A)
    out = n.tick(1.0)
    assert n.role is ElectionRole.PRE_CANDIDATE and n.term == 0
    assert not [a for a in out if isinstance(a, Persist)]
    assert {s.to for s in sends(out, PreVote)} == {B, C, D, E}
    voter = node(B)
    reply = voter.handle(A, PreVote(1, A, 0, 0), 1.0)
    assert reply == [ElectionSend(A, PreVoteReply(1, True, 0))] and voter.term == 0 and voter.voted_for is None
    n.handle(B, PreVoteReply(1, True, 0), 1.0)
    n.handle(C, PreVoteReply(1, True, 0), 1.0)
    assert n.role is ElectionRole.PRE_CANDIDATE  # 3 of 5: a majority, not a quorum
    out = n.handle(D, PreVoteReply(1, True, 0), 1.0)
    assert n.role is ElectionRole.CANDIDATE and n.term == 1
    assert out.index(Persist(1, A)) < out.index(sends(out, RequestVote)[0])


# ---------------------------------------------------------------------- leases


@pytest.mark.parametrize("dt, granted", [(0.05, False), (CFG.lease_s - 0.01, False), (CFG.lease_s + 0.01, True)])
def test_pre_vote_refused_while_the_coordinator_is_heard(dt, granted):
    n = follower_of(A, term=3, now=1.0)
    out = n.handle(C, PreVote(9, C, 0, 0), 1.0 + dt)  # an inflated term does not help
    assert sends(out)[0].msg.granted is granted
    assert n.term == 3 and n.coordinator == A


def test_vote_of_a_higher_term_refused_while_the_coordinator_is_heard_and_the_term_kept():
    n = follower_of(A, term=3, now=1.0)
    out = n.handle(C, request(9, C), 1.1)
    assert out == [ElectionSend(C, Vote(9, False, 3, b""))] and n.term == 3 and n.coordinator == A
    # ... but the coordinator itself may stand again in a higher term
    out = n.handle(A, request(10, A), 1.2)
    assert sends(out)[0].msg == vote(B, 10, A) and Persist(10, A) in out


def test_plain_raft_follows_a_higher_term_within_the_jump():
    n = node(B, config=PLAIN)
    n.handle(A, hb(3, A), 1.0)
    out = n.handle(C, request(9, C), 1.1)
    assert sends(out)[0].msg == vote(B, 9, C) and n.term == 9


def test_coordinator_refuses_pre_votes_and_other_candidates():
    n = coordinator(A)
    assert sends(n.handle(C, PreVote(5, C, 0, 0), 0.1))[0].msg.granted is False
    assert sends(n.handle(C, request(5, C), 0.1))[0].msg == Vote(5, False, 1, b"")
    assert n.role is ElectionRole.COORDINATOR


# ---------------------------------------------------------------------- coordinator


def _acks(n: ElectionState, voters, t_end: float):
    """Tick the coordinator every heartbeat until t_end, each of `voters` acking every heartbeat."""
    t, out = 0.0, []
    while t < t_end:
        t = round(t + CFG.heartbeat_interval_s, 6)
        actions = n.tick(t)
        out += actions
        for h in sends(actions, Heartbeat):
            if h.to in voters:
                out += n.handle(h.to, HeartbeatAck(h.msg.term, h.msg.seq, True, 0, 0), t + 0.001)
    return out


@pytest.mark.parametrize("acking, stays", [((B, C, D, E), True), ((B, C, D), True), ((B, C), False), ((B,), False),
                                           ((), False)])
def test_check_quorum_step_down_after_the_lease(acking, stays):
    n = coordinator(A)
    out = _acks(n, acking, 3 * CFG.lease_s)
    assert (n.role is ElectionRole.COORDINATOR) is stays
    downs = [a for a in out if isinstance(a, SteppedDown)]
    assert len(downs) == (0 if stays else 1)
    if not stays:
        assert CoordinatorKnown(1, None) in out and n.coordinator is None


def test_no_step_down_before_the_lease_has_run():
    n = coordinator(A)
    _acks(n, (), CFG.lease_s - 2 * CFG.heartbeat_interval_s)
    assert n.role is ElectionRole.COORDINATOR


def test_coordinator_heartbeats_voters_with_its_certificate_and_applied():
    n = coordinator(A)
    n.applied(1, 1)
    out = n.tick(CFG.heartbeat_interval_s)
    hbs = sends(out, Heartbeat)
    assert {h.to for h in hbs} == {B, C, D, E}
    assert hbs[0].msg.voters == FIVE and (hbs[0].msg.applied_term, hbs[0].msg.applied_epoch) == (1, 1)
    assert hbs[0].msg.coordinator == A and hbs[0].msg.term == 1
    assert hbs[0].msg.certificate == n.certificate == cert(1, A, (A, B, C, D))


@pytest.mark.parametrize("config, stands_again", [(CFG, True), (PLAIN, False)])
def test_coordinator_and_a_voter_ahead(config, stands_again):
    n = coordinator(A, config=config)
    out = n.handle(D, HeartbeatAck(7, 1, False, 0, 0), 0.1)
    down = [a for a in out if isinstance(a, SteppedDown)]
    assert len(down) == 1 and down[0].standing_again is stands_again
    if stands_again:  # at once in term 8, without a pre-vote
        assert n.role is ElectionRole.CANDIDATE and n.term == 8 and Persist(8, A) in out
        assert {s.to for s in sends(out, RequestVote)} == {B, C, D, E}
    else:
        assert n.role is ElectionRole.FOLLOWER and n.term == 7 and Persist(7, None) in out


def test_a_follower_learns_the_coordinator_and_answers_stale_ones():
    n = node(B)
    out = n.handle(A, hb(2, A, 5), 0.0)
    assert CoordinatorKnown(2, A) in out and Persist(2, None) in out
    assert sends(out)[-1].msg == HeartbeatAck(2, 5, True, 0, 0)
    assert n.certificate == hb(2, A).certificate
    out = n.handle(C, hb(1, C, 9), 0.1)
    assert out == [ElectionSend(C, HeartbeatAck(2, 9, False, 0, 0))] and n.coordinator == A
    assert n.handle(C, hb(2, A, 9), 0.2) == []  # claims to be another peer: ignored


def test_becoming_coordinator_is_an_event_with_a_certificate():
    n = node(A)
    n.campaign(0.0)
    for v in (B, C, D):
        n.handle(v, PreVoteReply(1, True, 0), 0.0)
    n.handle(B, vote(B, 1, A), 0.0)
    n.handle(C, vote(C, 1, A), 0.0)
    assert n.role is ElectionRole.CANDIDATE  # 3 votes of 5: a majority, one short of the quorum
    out = n.handle(D, vote(D, 1, A), 0.0)
    assert out[:2] == [BecameCoordinator(1), CoordinatorKnown(1, A)]
    assert len(sends(out, Heartbeat)) == 4
    assert n.certificate == cert(1, A, (A, B, C, D))
    # a late vote joins the certificate: it convinces peers whose configuration differs more
    n.handle(E, vote(E, 1, A), 0.01)
    assert n.certificate == cert(1, A, FIVE)


def test_votes_of_other_terms_non_voters_and_forgeries_do_not_count():
    n = node(A, config=PLAIN, term=3)
    n.campaign(0.0)
    assert n.term == 4
    n.handle(B, vote(B, 3, A), 0.0)  # an older term's vote
    n.handle(X, vote(X, 4, A), 0.0)  # not a voter
    n.handle(C, vote(C, 4, A, voters=(A, C, D)), 0.0)  # signed over another configuration
    n.handle(D, vote(C, 4, A), 0.0)  # C's signature, sent by D
    n.handle(B, vote(B, 4, A), 0.0)
    n.handle(B, vote(B, 4, A), 0.0)  # duplicated
    n.handle(C, vote(C, 4, A), 0.0)
    assert n.role is ElectionRole.CANDIDATE
    n.handle(D, vote(D, 4, A), 0.0)
    assert n.role is ElectionRole.COORDINATOR and n.certificate.signers == {A, B, C, D}


# ---------------------------------------------------------------------- configuration and allocations


def test_without_a_council_a_node_neither_votes_nor_stands():
    n = ElectionState(A, CFG, random.Random(0), 0.0, signer=SIGNERS[A])
    assert n.tick(100.0) == [] and n.role is ElectionRole.FOLLOWER
    assert n.handle(B, request(1, B), 100.0) == [] and n.handle(B, PreVote(1, B, 0, 0), 100.0) == []
    assert n.term == 0 and n.voted_for is None
    n.set_voters((A, B, C), 100.0)
    n.tick(200.0)
    assert n.role is ElectionRole.PRE_CANDIDATE


def test_a_peer_outside_the_configuration_learns_the_coordinator_from_a_passed_on_certificate():
    # A restarted peer (its configuration A..C, term 1) whose swarm went on without it: B was
    # elected in term 2 by B and C over (B, C, D). The certificate a peer passes on verifies
    # against A's own configuration (B and C are a quorum of A, B, C): A recognises B and takes
    # term 2 (persisted), without a lease (a certificate is no sign of life), and stops standing:
    # its voters answer no pre-vote of a peer outside their configuration.
    new = cert(2, B, (B, C), voters=(B, C, D))
    a = node(A, voters=(A, B, C), term=1)
    out = a.learn(new, 1.0)
    assert Persist(2, None) in out and CoordinatorKnown(2, B) in out
    assert (a.term, a.coordinator, a.role, a.heard_of) == (2, B, ElectionRole.FOLLOWER, None)
    assert not a.in_lease and a.answer(1.0).in_lease is False
    assert a.tick(100.0) == [] and a.role is ElectionRole.FOLLOWER  # no PreVote to anyone
    assert a.learn(new, 101.0) == [] and a.learn(cert(1, C, (A, C), voters=(A, B, C)), 101.0) == []
    # a heartbeat of its coordinator (it became a voter again) or an applied allocation ends that
    a.handle(B, hb(2, B, voters=(A, B, C)), 102.0)
    assert a.in_lease
    a.tick(200.0)
    assert a.role is ElectionRole.PRE_CANDIDATE


def test_a_peer_without_a_council_takes_nothing_from_a_certificate_alone():
    # A joiner with no council cannot check a certificate: whatever it is passed or sent, of
    # any term and any voters (its own name among them, a self-made quorum of sybils), it
    # recognises nobody, takes no term, keeps no coordinator to forward an operator's request
    # to, and never stands; the newest certificate that is a quorum of its own configuration is
    # only heard of (its status names it as its peers say). Only an allocation whose council
    # follows from the operator's root gives it a council
    # (test_a_joiner_takes_a_council_only_from_a_chain_from_its_root).
    e = ElectionState(E, CFG, random.Random(0), 0.0, signer=SIGNERS[E])
    one, two = cert(1, A, (A, B), voters=(A, B, C)), cert(2, B, (B, C), voters=(A, B, C))
    assert e.learn(one, 1.0) == [] and e.heard_of == one and e.coordinator is None
    assert e.learn(two, 1.0) == [] and e.heard_of == two and e.coordinator is None and e.term == 0
    sybils = cert(2**62, X, (X, Y, E), voters=(E, X, Y))
    assert e.learn(sybils, 1.0) == [] and e.term == 0 and e.coordinator is None
    assert e.handle(X, hb(2**62, X, voters=(E, X, Y)), 1.5) == [] and e.term == 0 and e.coordinator is None
    assert e.tick(100.0) == [] and e.role is ElectionRole.FOLLOWER
    assert e.answer(100.0) == CoordinatorAnswer(0, "follower", False, False, 0, e.heard_of)
    # what a peer passes on proves nothing by itself: the asker checks it again
    answer = CoordinatorAnswer(3, "follower", True, True, 3, two)
    assert CoordinatorAnswer.from_wire(unpack_untrusted(pack(answer.to_wire()), max_len=1 << 16)) == answer


@pytest.mark.parametrize("wire", [
    5, {}, {"term": 1, "role": "king", "recognised": False, "lease": False, "voters": 0, "cert": None},
    {"term": -1, "role": "follower", "recognised": False, "lease": False, "voters": 0, "cert": None},
    {"term": 1, "role": "follower", "recognised": 1, "lease": False, "voters": 0, "cert": None},
    {"term": 1, "role": "follower", "recognised": False, "lease": False, "voters": 0, "cert": {"t": 1}},
])
def test_a_coordinator_answer_is_checked(wire):
    with pytest.raises(ProtocolError):
        CoordinatorAnswer.from_wire(wire)


def test_why_no_coordinator_is_found_names_leases_and_voters():
    lease = CoordinatorAnswer(4, "follower", True, True, 3, cert(4, D, (C, D), voters=(C, D, E)))
    stale = CoordinatorAnswer(3, "pre-candidate", True, False, 3, cert(3, C, (C, D), voters=(C, D, E)))
    answers = {C: lease, D: stale, E: "unreachable"}
    why = explain(3, answers, (A, B, C), A)
    assert why.startswith("2 of the 3 peers asked answered; ")
    assert f"{short_id(C)} holds a lease of coordinator {short_id(D)} (term 4)" in why
    assert f"{short_id(D)} last heard of coordinator {short_id(C)} (term 3), not within its lease" in why
    assert "2 of the 3 voters of this peer's configuration answer (2 elect a coordinator)" in why
    assert f"no answer from {short_id(E)} (unreachable)" in why
    assert "configurations of 3 voters" in explain(1, {C: lease}, (), A)
    assert "no other live peer is known" in explain(0, {}, (), A)


def test_a_single_voter_elects_itself():
    n = node(A, voters=(A,))
    out = n.campaign(0.0)
    assert BecameCoordinator(1) in out and n.coordinator == A and n.certificate.signers == {A}


def test_a_coordinator_left_out_of_a_new_root_steps_down():
    n = coordinator(A)
    assert n.set_root(Council(b"start", (B, C, D), 5), 0.1) == []  # a start's root: only for a peer without one
    assert n.role is ElectionRole.COORDINATOR
    out = n.set_root(Council(b"council", (B, C, D), 5), 0.1, rerooting=True)  # the operator re-roots
    assert n.role is ElectionRole.FOLLOWER and any(isinstance(a, SteppedDown) for a in out)
    assert n.voters == (B, C, D) and n.previous is None
    assert n.set_root(Council(b"older", (A, B), 4), 0.2, rerooting=True) == [] and n.voters == (B, C, D)
    with pytest.raises(ValueError):
        Council(b"", (C, B), 1)  # unsorted


def test_the_voters_change_only_by_an_applied_allocation():
    n = follower_of(A, term=3)
    c = hb(3, A).certificate
    n.apply_allocation(3, 1, council(), c, 0.1)
    assert n.set_voters((A, B), 0.2) == [] and n.voters == FIVE  # refused: only allocations change them now
    n.handle(A, Heartbeat(3, A, 2, 3, 1, cert(3, A, (A, B), voters=(A, B))), 0.3)
    assert n.voters == FIVE  # never from a heartbeat
    four = changed(council(), (A, B, C, D), c)
    assert n.may_apply(A, 3, 2, c, four) is None
    n.apply_allocation(3, 2, four, c, 0.4)
    assert n.voters == (A, B, C, D) and n.last_applied == (3, 2) and n.council == four


def test_a_council_changes_one_voter_at_a_time_certified_by_the_council_before():
    # What every configured peer checks on receipt of an allocation: its council is this peer's,
    # or this peer's followed by changes, each one voter, signed by its maker over a certificate
    # of the council before it, none after the allocation's term and those of its term by its
    # issuer, a voter added only below the root's size. A coordinator elected once cannot put a
    # council of its own making in, nor grow it past its size.
    root7 = Council(b"", FIVE, 0, 7)
    n = follower_of(A, term=3, council=root7)
    c = hb(3, A).certificate
    assert n.may_apply(A, 3, 1, c, root7) is None
    sybils = Council(b"", tuple(sorted(FIVE + (X, Y))), 0, 7)  # a new root of its own making
    assert "does not follow" in n.may_apply(A, 3, 1, c, sybils).reason
    with pytest.raises(ValueError, match="one voter at a time"):
        changed(root7, FIVE[:3], c)  # two out at once
    with pytest.raises(ValueError, match="one voter at a time"):
        changed(root7, tuple(sorted(FIVE + (X, Y))), c)  # two in at once
    one = changed(root7, tuple(sorted(FIVE + (X,))), c)
    two = changed(one, tuple(sorted(FIVE + (X, Y))), cert(3, A, (A, B, C, D, X), voters=one.voters))
    assert n.may_apply(A, 3, 1, c, one) is None
    assert n.may_apply(A, 3, 2, c, two) is None  # each change certified by the council before it
    assert "not one its issuer made before" in n.may_apply(A, 3, 1, c, two).reason  # (a change of epoch 2 in epoch 1)
    full = follower_of(A, term=3)  # a root of size 5
    assert "its root's size" in full.may_apply(A, 3, 1, c, changed(council(), tuple(sorted(FIVE + (X,))), c)).reason
    other = changed(root7, tuple(sorted(FIVE + (X,))), cert(3, C, (A, B, C, D)))  # made by another peer
    assert "not one its issuer made" in n.may_apply(A, 3, 1, c, other).reason
    later = changed(root7, tuple(sorted(FIVE + (X,))), cert(4, A, (A, B, C, D)))  # of a term after the allocation's
    assert n.may_apply(A, 3, 1, c, later).code == "bad-council"
    forged = root7.extended(CouncilLink(c, one.voters, SIGNERS[X].sign(b"not A's")))
    assert "not signed by its issuer" in n.may_apply(A, 3, 1, c, forged).reason
    n.apply_allocation(3, 1, one, c, 0.1)
    assert n.voters == one.voters and n.council == one
    assert "does not follow" in n.may_apply(A, 3, 2, c, root7).reason  # no going back to an older council


def test_a_joiner_takes_a_council_only_from_a_chain_from_its_root():
    # A peer without a council checks the whole chain an allocation carries: every link
    # certified by a quorum of the council before it and signed by its issuer, the allocation's
    # certificate over the last council (or the one before, when this allocation made the last
    # change). The root itself is the plane's to check (control/operator.py check_council).
    j = ElectionState(X, CFG, random.Random(0), 0.0, signer=SIGNERS[X])
    c = cert(3, A, (A, B, C, D))
    assert j.may_apply(A, 3, 1, c, council()) is None
    four = changed(council(), (A, B, C, D), c)
    assert j.may_apply(A, 3, 1, c, four) is None  # this allocation made the change
    c4 = cert(4, B, (A, B, C), voters=(A, B, C, D))
    assert j.may_apply(B, 4, 1, c4, four) is None  # a later coordinator of the four
    assert j.may_apply(B, 4, 1, cert(4, B, (B, C, D, E)), four).code == "bad-certificate"  # over the old five
    two_forged = Certificate(3, A, FIVE, cert(3, A, (A, B, C, D)).votes[:2] + ((2, bytes(64)), (3, bytes(64))))
    bad = council().extended(CouncilLink(two_forged, (A, B, C, D), SIGNERS[A].sign(link_payload(3, 1, FIVE, (A, B, C, D)))))
    assert "is not its signature" in j.may_apply(A, 3, 1, c, bad).reason
    own = Council(b"", (A, X, Y), 0)  # a self-made council of sybils: a root the plane refuses
    assert j.may_apply(X, 9, 1, cert(9, X, (X, Y), voters=(A, X, Y)), own) is None  # (its root is the plane's)
    j.apply_allocation(4, 1, four, c4, 0.1)
    assert (j.voters, j.term, j.coordinator) == ((A, B, C, D), 4, B)


def test_a_configuration_change_the_next_coordinator_never_saw_is_undone_by_it():
    """Coordinator C of term 3 drops A (three voters to two) and applies it; C is lost before
    B applies it. A and B, a quorum of the three, elect B in term 4, and B hands out its
    allocations: C, back, takes them (the change never reached a quorum of the two), though A's
    and B's votes are one of its two voters; not a certificate of the change's own term, nor
    one after a later term kept the two."""
    three, two = (A, B, C), (B, C)
    root = council(three)
    n = node(C, voters=three)
    n.handle(C, hb(3, C, voters=three), 0.0)
    c3 = cert(3, C, (B, C), three)
    n.apply_allocation(3, 1, root, c3, 0.1)
    assert n.previous is None  # the first configuration applied here changed nothing
    dropped = changed(root, two, c3)
    n.apply_allocation(3, 2, dropped, cert(3, C, (B, C), two), 0.2)
    assert n.voters == two and n.previous == PreviousConfiguration(three, 3)
    later = cert(4, B, (A, B), three)
    assert n.may_apply(B, 4, 1, later, root) is None
    assert n.may_apply(A, 4, 1, cert(4, A, (A, B), three), root) is None  # A: a voter of the three
    assert n.may_apply(B, 4, 1, cert(4, B, (B, X), (B, X, Y)), root).code == "bad-certificate"  # 1 of three
    restarted = node(C, council=dropped, applied=(3, 2), previous=n.previous)  # as applied.json keeps it
    assert restarted.may_apply(B, 4, 1, later, root) is None
    assert restarted.may_apply(B, 3, 3, cert(3, B, (A, B), three), root) is not None  # its own term
    forgot = node(C, council=dropped, applied=(3, 2))
    assert "does not follow" in forgot.may_apply(B, 4, 1, later, root).reason
    out = n.apply_allocation(4, 1, root, later, 0.3)
    assert CoordinatorKnown(4, B) in out and n.voters == three and n.previous == PreviousConfiguration(two, 4)
    kept = node(C, council=dropped, applied=(3, 2), previous=PreviousConfiguration(three, 3))
    kept.apply_allocation(5, 1, dropped, cert(5, B, (B, C), two), 0.1)  # a coordinator of term 5 keeps the two
    assert kept.previous is None and kept.may_apply(B, 6, 1, cert(6, B, (A, B), three), root).code is not None


@pytest.mark.parametrize("issuer, term, epoch, applied, signers, code", [
    (A, 3, 1, (2, 5), (A, B, C, D), None),  # a newer term starts its epochs anew
    (A, 3, 3, (3, 2), (A, B, C, D), None),
    (A, 4, 1, (0, 0), (A, C, D, E), None),  # a newer term, certified: applied without a heartbeat first
    (A, 3, 2, (3, 2), (A, B, C, D), "stale"),  # already applied
    (A, 3, 1, (3, 2), (A, B, C, D), "stale"),  # an older epoch of this term
    (A, 2, 7, (0, 0), (A, B, C, D), "stale"),  # an older term
    (C, 3, 1, (0, 0), (A, B, C, D), "not-coordinator"),  # another coordinator of the term is known here
    (A, 4, 1, (0, 0), "minority", "bad-certificate"),  # a quorum of its own voters, a minority of ours
    (A, 4, 1, (0, 0), "majority", "bad-certificate"),  # 3 of our 5 voters: a majority, not a quorum
    (A, 4, 1, (0, 0), None, "bad-certificate"),  # no certificate
    (A, 4, 1, (0, 0), "of-c", "bad-certificate"),  # a certificate of another peer
    (A, 4, 1, (0, 0), "forged", "bad-certificate"),  # a vote in it is not its voter's signature
    (X, 4, 1, (0, 0), "of-x", "not-voter"),  # an issuer outside the configuration, certified by its own
])
def test_may_apply(issuer, term, epoch, applied, signers, code):
    n = follower_of(A, term=3, applied=applied)
    if signers is None:
        c = None
    elif signers == "of-c":
        c = cert(term, C, (A, B, C, D))
    elif signers == "forged":
        good = cert(term, A, (A, B, C, D))
        c = Certificate(term, A, FIVE, good.votes[:3] + ((3, SIGNERS[D].sign(b"something else")),))
    elif signers == "minority":
        c = cert(term, A, (A, B), voters=(A, B, X))
    elif signers == "majority":  # a certificate of our five voters with 3 votes cannot be built: of six
        c = cert(term, A, (A, B, C, X), voters=tuple(sorted(FIVE + (X,))))
    elif signers == "of-x":
        c = cert(term, X, (X, Y), voters=(X, Y))
    else:
        c = cert(term, issuer, signers)
    refusal = n.may_apply(issuer, term, epoch, c, council())
    assert (refusal.code if refusal else None) == code


def test_applied_only_grows():
    n = follower_of(A, term=3)
    c = hb(3, A).certificate
    assert n.may_apply(A, 3, 1, c, council()) is None
    n.applied(3, 1)
    assert n.may_apply(A, 3, 1, c, council()).code == "stale"
    with pytest.raises(ValueError):
        n.applied(3, 1)
    n.applied(3, 2)
    assert n.last_applied == (3, 2)
    assert n.apply_allocation(3, 2, council(), c, 0.1) == [] and n.last_applied == (3, 2)  # refused, logged


def test_an_allocation_of_a_newer_certified_term_is_followed():
    n = node(B, term=2)
    c = cert(5, C, (B, C, D, E))
    assert n.may_apply(C, 5, 1, c, council()) is None
    out = n.apply_allocation(5, 1, council(), c, 0.0)
    assert Persist(5, None) in out and CoordinatorKnown(5, C) in out
    assert (n.term, n.coordinator, n.last_applied, n.certificate) == (5, C, (5, 1), c)


# ---------------------------------------------------------------------- time


def test_timers_are_random_within_the_range_and_staggered_by_rank():
    deadlines = []
    for seed in range(20):
        n = node(A, rng=random.Random(seed))
        deadlines.append(n.next_deadline())
    c = CFG
    assert len(set(deadlines)) == 20
    assert all(c.election_timeout_min_s <= t <= c.election_timeout_max_s + 4 * c.stagger_s for t in deadlines)
    # every voter of a term has its own slot: the earliest possible deadlines differ by stagger_s
    ranks = sorted(round((node(v, config=c.with_(election_timeout_max_s=c.election_timeout_min_s + 1e-9))
                          .next_deadline() - c.election_timeout_min_s) / c.stagger_s) for v in FIVE)
    assert ranks == [0, 1, 2, 3, 4]


def test_a_clock_going_back_keeps_the_intervals():
    n = follower_of(A, term=1, now=10.0)
    left = n.next_deadline() - 10.0
    n.tick(5.0)  # the clock went back by 5 s
    assert n.next_deadline() - 5.0 == pytest.approx(left)
    assert sends(n.handle(C, PreVote(2, C, 0, 0), 5.1))[0].msg.granted is False  # still in the lease


# ---------------------------------------------------------------------- wire


_IDS = st.binary(min_size=32, max_size=32)
_SIGS = st.binary(min_size=64, max_size=64)


@st.composite
def _certificates(draw, term=st.integers(1, 99)):
    """Well-formed certificates, their signatures any 64 bytes (nothing here verifies them)."""
    voters = tuple(sorted(draw(st.lists(_IDS, min_size=1, max_size=9, unique=True))))
    count = draw(st.integers(quorum(len(voters)), len(voters)))
    indices = sorted(draw(st.permutations(range(len(voters))))[:count])
    return Certificate(draw(term), draw(st.sampled_from(voters)), voters, tuple((i, draw(_SIGS)) for i in indices))


_MESSAGES = st.one_of(
    st.builds(PreVote, st.integers(1, 2**63 - 1), _IDS, st.integers(0, 9), st.integers(0, 9)),
    st.builds(PreVoteReply, st.integers(1, 99), st.booleans(), st.integers(0, 99)),
    st.builds(RequestVote, st.integers(1, 99), _IDS, st.integers(0, 9), st.integers(0, 9), _IDS),
    st.builds(lambda t, g, vt, sig: Vote(t, g, t if g else vt, sig if g else b""),
              st.integers(1, 99), st.booleans(), st.integers(0, 99), _SIGS),
    st.builds(lambda c, s, a: Heartbeat(c.term, c.candidate, s, a, a, c), _certificates(), st.integers(0, 99),
              st.integers(0, 9)),
    st.builds(HeartbeatAck, st.integers(0, 99), st.integers(0, 99), st.booleans(), st.integers(0, 9),
              st.integers(0, 9)),
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_MESSAGES)
def test_messages_round_trip(msg):
    assert decode_election(unpack_untrusted(pack(msg.to_wire()), max_len=1 << 20)) == msg


_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.binary(max_size=40),
                    st.text(max_size=8), st.floats(allow_nan=False))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.one_of(st.recursive(_LEAVES, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c,
                                                                                             max_size=8), max_leaves=20),
                 _MESSAGES.flatmap(lambda m: st.fixed_dictionaries(
                     {k: st.just(v) | _LEAVES for k, v in m.to_wire().items()}))))
def test_garbage_raises_only_protocol_error(obj):
    try:
        msg = decode_election(obj)
    except ProtocolError:
        return
    assert decode_election(msg.to_wire()) == msg


_SIG = b"\x07" * 64
_CERT = {"t": 1, "c": A, "v": [A, B, C], "s": [[0, _SIG], [2, _SIG]]}


def _hb_wire(**cert) -> dict:
    return {"k": 4, "t": 1, "c": A, "s": 0, "at": 0, "ae": 0, "cert": {**_CERT, **cert}}


@pytest.mark.parametrize("wire", [
    {"k": 3, "t": 1, "g": 1, "vt": 1, "sig": b""},  # an int is not a bool
    {"k": 3, "t": -1, "g": False, "vt": 1, "sig": b""},
    {"k": 3, "t": True, "g": False, "vt": 1, "sig": b""},  # a bool is not an int
    {"k": 3, "t": 1, "g": False, "vt": 1, "sig": b"", "x": 0},  # an extra field
    {"k": 3, "t": 1, "g": True, "vt": 1, "sig": b""},  # a granted vote without its signature
    {"k": 3, "t": 1, "g": True, "vt": 2, "sig": _SIG},  # ... or in another term than it grants
    {"k": 3, "t": 1, "g": False, "vt": 1, "sig": _SIG},  # a refused vote with one
    {"k": 3, "t": 2**63, "g": False, "vt": 1, "sig": b""},  # a term past the largest
    {"k": 9, "t": 1, "g": True},  # an unknown kind
    {"k": 0, "t": 1, "c": b"\x01" * 31, "at": 0, "ae": 0},  # a 31-byte peer id
    {"k": 0, "t": 0, "c": b"\x01" * 32, "at": 0, "ae": 0},  # standing in term 0
    {"k": 2, "t": 1, "c": A, "at": 0, "ae": 0, "d": b"\x01" * 31},  # a short configuration digest
    {"k": 2, "t": 1, "c": A, "at": 0, "ae": 0},  # no configuration digest
    {"k": 4, "t": 1, "c": A, "s": 0, "at": 0, "ae": 0},  # a heartbeat without a certificate
    _hb_wire(v=[B, A, C]),  # voters not sorted
    _hb_wire(v=[A, A, C]),  # a voter twice
    _hb_wire(v=[]),  # no voters
    _hb_wire(c=B),  # the certificate of another peer
    _hb_wire(t=2),  # ... of another term
    _hb_wire(c=D),  # of a peer not among its voters
    _hb_wire(s=[[0, _SIG]]),  # one vote of three voters
    _hb_wire(s=[[2, _SIG], [0, _SIG]]),  # votes out of order
    _hb_wire(s=[[0, _SIG], [0, _SIG]]),  # a vote twice
    _hb_wire(s=[[0, _SIG], [3, _SIG]]),  # a vote of no voter
    _hb_wire(s=[[0, _SIG], [1, b"\x07" * 63]]),  # a short signature
    _hb_wire(s=[[0, _SIG], [1]]),  # not a pair
    _hb_wire(v=[i.to_bytes(32, "big") for i in range(1, 4098)]),  # more voters than MAX_VOTERS
    {**_hb_wire(), "cert": [1, A]},  # not a map
    {"k": 5, "t": 1, "s": 2**63, "ok": True, "at": 0, "ae": 0},  # seq out of range
])
def test_decode_refuses(wire):
    with pytest.raises(ProtocolError):
        decode_election(wire)


# ---------------------------------------------------------------------- store


def test_file_store_round_trip_and_fresh_start(tmp_path):
    store = FileElectionStore(tmp_path / "data")
    assert store.load() == (0, None)
    store.persist(3, A)
    assert FileElectionStore(tmp_path / "data").load() == (3, A)
    store.persist(4, None)
    assert store.load() == (4, None)
    assert os.listdir(tmp_path / "data") == ["election.json"]  # no temporary file left behind


def test_file_store_fsyncs_file_then_renames_then_fsyncs_dir(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append(("replace", str(b))), real_replace(a, b))[1])
    FileElectionStore(tmp_path).persist(1, B)
    assert calls == [("fsync", False), ("replace", str(tmp_path / "election.json")), ("fsync", True)]


@pytest.mark.parametrize("content", [b"", b"{", b"[]", b'{"version": 1, "term": -1, "voted_for": null}',
                                     b'{"version": 2, "term": 1, "voted_for": null}',
                                     b'{"version": 1, "term": 1, "voted_for": "abcd"}',
                                     b'{"version": 1, "term": 1}', b"x" * 5000])
def test_damaged_store_is_an_error_not_a_fresh_start(tmp_path, content):
    (tmp_path / "election.json").write_bytes(content)
    with pytest.raises(ElectionStoreError, match="damaged"):
        FileElectionStore(tmp_path).load()


def test_a_restarted_node_keeps_its_vote():
    store = MemoryElectionStore()
    n = node(B)
    for a in n.handle(A, request(1, A), 0.0):
        if isinstance(a, Persist):
            store.persist(a.term, a.voted_for)
    term, voted_for = store.load()
    again = ElectionState(B, CFG, random.Random(1), 0.0, signer=SIGNERS[B], term=term, voted_for=voted_for,
                          voters=FIVE)
    assert sends(again.handle(C, request(1, C), 0.0))[0].msg == Vote(1, False, 1, b"")
    assert sends(again.handle(A, request(1, A), 0.0))[0].msg == vote(B, 1, A)


# ---------------------------------------------------------------------- lying insiders


def _state(n: ElectionState) -> tuple:
    return (n.term, n.voted_for, n.role, n.coordinator, n.certificate, n.voters, n.last_applied, n.next_deadline())


@pytest.mark.parametrize("src, msg", [
    # a never-elected identity names itself coordinator, its configuration itself alone
    (X, Heartbeat(4, X, 1, 9, 9, cert(4, X, (X,), voters=(X,)))),
    # ... with a configuration of this swarm's voters and itself, signing for itself alone
    (X, Heartbeat(4, X, 1, 9, 9, Certificate(4, X, FIVE[:2] + (X,), ((0, bytes(64)), (2, SIGNERS[X].sign(b"x")))))),
    # a voter does the same
    (C, Heartbeat(4, C, 1, 9, 9, cert(4, C, (C,), voters=(C,)))),
    # a certificate that is a quorum of its own voters, a minority of this peer's
    (C, Heartbeat(4, C, 1, 0, 0, cert(4, C, (C, X), voters=(A, C, X)))),
    # a quorum of this peer's voters, one of them forged
    (C, Heartbeat(4, C, 1, 0, 0, Certificate(4, C, FIVE, cert(4, C, (B, C, D, E)).votes[:3] + ((4, bytes(64)),)))),
    # a majority of this peer's voters (3 of 5), in a configuration of six: not a quorum of ours
    (C, Heartbeat(4, C, 1, 0, 0, cert(4, C, (B, C, D, X), voters=tuple(sorted(FIVE + (X,)))))),
    # a true certificate of A, sent by C
    (C, hb(4, A)),
    # votes and answers nobody asked for, in the largest term
    (A, PreVoteReply(1, False, HUGE)),
    (A, PreVoteReply(2, True, HUGE)),
    (A, Vote(HUGE, False, HUGE, b"")),
    (A, Vote(3, False, HUGE, b"")),
    (A, vote(A, 3, B)),
    (A, HeartbeatAck(HUGE, 1, False, 0, 0)),
    # requests of outsiders: no answer, no term
    (X, PreVote(4, X, 9, 9)),
    (X, request(4, X, (9, 9))),
    # a voter's request for a term too far ahead, and its pre-vote
    (A, request(HUGE, A)),
    (A, PreVote(HUGE, A, 0, 0)),
])
def test_a_liars_message_changes_nothing(src, msg):
    n = node(B, term=3)
    before = _state(n)
    out = n.handle(src, msg, 0.0)
    assert _state(n) == before
    assert not [a for a in out if isinstance(a, Persist) or (isinstance(a, ElectionSend) and a.msg.kind in (0, 2))]
    if src in (X, Y) or isinstance(msg, (Heartbeat, PreVoteReply, Vote, HeartbeatAck)):
        assert out == []  # an outsider gets no answer; nobody gets one to an answer or a forgery


def test_a_forged_heartbeat_does_not_make_a_follower_drop_its_coordinator():
    n = follower_of(A, term=3, now=1.0)
    before = _state(n)
    for m in (Heartbeat(4, X, 1, 9, 9, cert(4, X, (X,), voters=(X,))), Heartbeat(3, X, 1, 9, 9, cert(3, X, (X,),
                                                                                                      voters=(X,)))):
        assert n.handle(X, m, 1.1) == []
    assert _state(n) == before


@pytest.mark.parametrize("config", [CFG, PLAIN])
def test_answers_to_this_peers_own_round_move_its_term_within_the_jump_only(config):
    n = node(A, config=config, term=3)
    n.tick(10.0)
    if config.pre_vote:
        assert n.role is ElectionRole.PRE_CANDIDATE
        assert n.handle(B, PreVoteReply(4, False, 4 + CFG.max_term_jump), 10.0) == [] and n.term == 3
        assert n.handle(X, PreVoteReply(4, False, 5), 10.0) == [] and n.term == 3  # not a voter
        n.handle(B, PreVoteReply(4, False, 3 + CFG.max_term_jump), 10.0)
        assert n.term == 3 + CFG.max_term_jump and n.role is ElectionRole.FOLLOWER
    else:
        assert n.role is ElectionRole.CANDIDATE and n.term == 4
        assert n.handle(B, Vote(4, False, 5 + CFG.max_term_jump, b""), 10.0) == [] and n.term == 4
        assert n.handle(B, Vote(3, False, 9, b""), 10.0) == [] and n.term == 4  # another round's answer
        n.handle(B, Vote(4, False, 4 + CFG.max_term_jump, b""), 10.0)
        assert n.term == 4 + CFG.max_term_jump and n.role is ElectionRole.FOLLOWER


def test_a_coordinator_stands_again_only_for_an_ack_of_its_own_heartbeat_within_the_jump():
    n = coordinator(A)
    assert n.handle(B, HeartbeatAck(5, 99, False, 0, 0), 0.1) == []  # no heartbeat 99 was sent
    assert n.handle(B, HeartbeatAck(1 + CFG.max_term_jump, 1, False, 0, 0), 0.1) == []
    assert n.handle(X, HeartbeatAck(5, 1, False, 0, 0), 0.1) == []  # not a voter
    assert n.role is ElectionRole.COORDINATOR and n.term == 1
    n.handle(B, HeartbeatAck(CFG.max_term_jump, 1, False, 0, 0), 0.1)
    assert n.role is ElectionRole.CANDIDATE and n.term == 1 + CFG.max_term_jump


def test_a_certified_term_is_taken_at_any_size_and_then_the_peer_never_stands():
    n = follower_of(A, term=3)
    out = n.handle(C, hb(HUGE, C), 1.0)
    assert n.term == MAX_TERM == HUGE and n.coordinator == C and Persist(HUGE, None) in out
    assert n.term_exhausted
    for t in (10.0, 20.0, 30.0):  # its coordinator is gone: its timer fires, it does not stand
        assert n.tick(t) == [] and n.role is ElectionRole.FOLLOWER
    assert n.campaign(40.0) == []
    # it still votes, and a coordinator at the largest term cannot be deposed by an ack past it
    assert sends(n.handle(D, request(HUGE, D), 41.0))[0].msg.granted


def test_at_the_largest_term_no_arithmetic_overflows():
    n = node(A, term=HUGE - 1)
    n.campaign(0.0)
    for v in (B, C, D):
        n.handle(v, PreVoteReply(HUGE, True, HUGE - 1), 0.0)
    for v in (B, C, D):
        n.handle(v, vote(v, HUGE, A), 0.0)
    assert n.role is ElectionRole.COORDINATOR and n.term == HUGE
    assert n.handle(B, HeartbeatAck(HUGE, 1, False, 0, 0), 0.1) == []  # would stand in 2^63: ignored
    n.tick(0.1 + 3 * CFG.lease_s)  # no acks: steps down
    assert n.role is ElectionRole.FOLLOWER
    assert n.tick(100.0) == [] and n.role is ElectionRole.FOLLOWER


def test_a_peer_without_a_council_follows_no_heartbeat_and_applies_as_a_follower():
    n = node(B, voters=None)
    three = (A, C, D)
    assert n.handle(A, hb(1, A, voters=three, signers=(A, C)), 0.0) == []
    assert n.handle(A, hb(1, A, voters=(A, B, C), signers=(A, C)), 0.0) == []  # even one naming it
    assert n.coordinator is None and n.voters == () and n.term == 0
    # its first allocation: any whose chain checks, a voter of it or not (peers outside the council follow)
    c = cert(1, A, (A, C), voters=three)
    assert n.may_apply(A, 1, 1, c, council(three)) is None
    n.apply_allocation(1, 1, council(three), c, 0.1)
    assert n.voters == three and n.last_applied == (1, 1) and n.coordinator == A
    assert n.handle(C, request(2, C, applied=(1, 1), voters=three), 0.2) == []  # outside the council: never votes


def test_a_certificate_is_verified_once():
    n = follower_of(A, term=3)
    c = hb(4, A).certificate
    checked = n.signatures_checked
    for epoch in range(1, 20):
        assert n.may_apply(A, 4, epoch, c, council()) is None
    assert n.signatures_checked == checked + 4


def test_after_a_configuration_change_the_coordinator_is_certified_again():
    n = coordinator(A)
    c1 = n.certificate
    four = (A, B, C, D)
    out = n.apply_allocation(1, 1, changed(council(), four, c1), c1, 0.1)
    asks = sends(out, RequestVote)
    assert {a.to for a in asks} == {B, C, D} and asks[0].msg.config == config_digest(four) and asks[0].msg.term == 1
    # a voter that voted for A in term 1 signs again, over the new configuration, without a second vote
    voter = node(C, term=1, voted_for=A, applied=(1, 1), voters=four)
    answer = voter.handle(A, asks[0].msg, 0.11)
    assert answer == [ElectionSend(A, vote(C, 1, A, four))]
    n.handle(C, vote(C, 1, A, four), 0.12)
    assert n.certificate == c1
    n.handle(D, vote(D, 1, A, four), 0.12)
    assert n.certificate == cert(1, A, (A, C, D), voters=four) and n.role is ElectionRole.COORDINATOR
    assert sends(n.tick(0.2), Heartbeat)[0].msg.certificate == n.certificate


def test_a_coordinator_not_certified_again_in_time_stands_in_the_new_configuration():
    # B, C and D elected A in term 1 among five; the new configuration drops B and adds X. C and
    # X never sign A again (X voted for another candidate in term 1): after the longest election
    # timeout A stands in term 2 among the new voters, whose votes make a certificate they check.
    n = coordinator(A, config=CFG.with_(check_quorum=False))  # (no acks are fed here)
    new = tuple(sorted((A, C, D, E, X)))
    n.apply_allocation(1, 1, council(new), n.certificate, 0.1)  # (two changes: applied as told, may_apply aside)
    n.handle(D, vote(D, 1, A, new), 0.12)
    assert n.certificate.config == config_digest(FIVE)  # 2 of 5 signed again: not a quorum
    early = n.tick(0.1 + CFG.election_timeout_max_s - 0.01)
    assert n.role is ElectionRole.COORDINATOR and not any(isinstance(a, SteppedDown) for a in early)
    out = n.tick(0.1 + CFG.election_timeout_max_s)
    assert any(isinstance(a, SteppedDown) and a.standing_again for a in out) and Persist(2, A) in out
    asks = sends(out, RequestVote)
    assert {a.to for a in asks} == set(new) - {A} and asks[0].msg.term == 2 and asks[0].msg.config == config_digest(new)
    for v in (C, D, E):
        n.handle(v, vote(v, 2, A, new), 0.2)
    assert n.role is ElectionRole.COORDINATOR and n.term == 2 and n.certificate == cert(2, A, (A, C, D, E), voters=new)


def split_vote(sim: ElectionSim, liar: int, candidates) -> None:
    """The coordinators crash, their leases run out, they restart as followers, and `candidates`
    stand at once, while the liar grants every pre-vote and vote it is asked for, to each of
    them: with plain majorities of five voters, two candidates that split the four honest votes
    2 : 2 both win, each with the liar's vote."""
    for k in sim.coordinators():
        sim.crash(k)
    sim.run_for(CFG.lease_s + 0.01)
    for k in range(sim.n):
        sim.restart(k)
    for k in set(candidates) - {liar}:
        sim.campaign(k)
    key, answered = sim.signers[sim.ids[liar]], set()
    for _ in range(40):
        sim.run_for(0.01)
        for src, m in list(sim.inbox[liar]):
            if isinstance(m, (PreVote, RequestVote)) and m.candidate == sim.ids[src] and (src, m) not in answered:
                answered.add((src, m))
                if isinstance(m, PreVote):
                    sim.inject(liar, src, PreVoteReply(m.term, True, m.term - 1))
                else:
                    sim.inject(liar, src, Vote(m.term, True, m.term, key.sign(vote_payload(m.term, m.candidate,
                                                                                           m.config))))


@pytest.mark.parametrize("seed", range(12))
def test_a_lying_voter_cannot_elect_two_coordinators_in_one_term(seed):
    """Four honest voters and a liar: two stand at once and the liar votes for both. The quorum
    of five is 4, so at most one of them wins (with majorities of 3, about half of these seeds
    elected both)."""
    sim = ElectionSim(5, CFG, seed=seed, codec=False, liars=(4,), conditions=NetConditions(jitter=1.0))
    sim.run_for(1.5)
    split_vote(sim, 4, [0, 1])
    sim.run_for(2.0)
    assert sim.violations == []
    assert all(n == 1 for n in Counter(t for t, _ in sim.certificates).values())
    assert sim.coordinators()  # and the swarm still elects


MINTED = [Identity(bytes([200 + i]) * 32) for i in range(12)]  # identities a liar makes for itself
MINTED_IDS = frozenset(k.peer_id for k in MINTED)
MINTED_IDS_SORTED = sorted(MINTED_IDS)


class ByzantineElection(SimFaults):
    """A liar holding a real key (a voter or not) sends well-formed election messages with
    arbitrary fields, and allocations, to the real machines of the election simulation: votes
    it signs, certificates it forges or assembles from the votes it was sent or makes with
    identities it minted, over any voter set, councils of its own making, terms up to the
    largest, and votes for two candidates in one term; it turns nodes into joiners (no council)
    and offers them the same. The simulation's checks (true
    certificates, one coordinator per term, applied (term, epoch) only grows) hold, and no
    machine raises. A voting liar is one of 4 to 6 voters: the quorum tolerates one liar from 4
    voters on (with 3, a majority, two quorums share the liar alone)."""

    def __init__(self):
        super().__init__()
        self.sim = None

    @initialize(n=st.integers(3, 5), seed=st.integers(0, 2**32), codec=st.booleans())
    def start(self, n, seed, codec):
        liar_votes = seed % 3 != 0  # from the seed: hypothesis's simplest boolean would leave it out mostly
        n += 1  # the liar besides 3 to 5 honest voters: a voter of 4 to 6, or an outsider
        self.sim = ElectionSim(n, CFG, seed=seed, codec=codec, liars=(n - 1,),
                               conditions=NetConditions(jitter=1.0), liars_vote=liar_votes)
        self.liar = n - 1
        self.key = self.sim.signers[self.sim.ids[self.liar]]
        self.sim.run_for(1.5)
        self.applied_before = list(self.sim.disk_applied)

    def _certificate(self, how: int, term: int, candidate: bytes) -> Certificate:
        sim, me = self.sim, self.sim.ids[self.liar]
        if how == 0:  # a configuration of its own
            return Certificate.of(term, me, (me,), {me: self.key.sign(vote_payload(term, me, config_digest((me,))))})
        if how == 3:  # over the swarm's voters, itself and identities it minted, signed by itself and them
            voters = tuple(sorted(set(sim.voters) | {me} | MINTED_IDS))
            payload = vote_payload(term, me, config_digest(voters))
            return Certificate.of(term, me, voters, {k.peer_id: k.sign(payload) for k in [self.key, *MINTED]})
        voters = tuple(sorted(set(sim.voters) | {me}))
        payload = vote_payload(term, candidate, config_digest(voters))
        sigs = {v: (self.key.sign(payload) if v == me else bytes(64)) for v in voters}
        if how == 2:  # the votes it was sent, for itself (forgeries to make up a quorum)
            payload = vote_payload(term, me, config_digest(voters))
            sigs = {me: self.key.sign(payload)}
            for src, m in sim.inbox[self.liar]:
                if isinstance(m, Vote) and m.granted and m.term == term and verify_signature(sim.ids[src], payload,
                                                                                             m.signature):
                    sigs[sim.ids[src]] = m.signature
            for v in voters:
                if len(sigs) < quorum(len(voters)):
                    sigs.setdefault(v, bytes(64))
        return Certificate.of(term, candidate if how != 2 else me, voters, sigs)

    @rule(equivocate=st.booleans(), crash_first=st.booleans())
    def stand(self, equivocate, crash_first):
        """The liar stands as an honest candidate would (and, equivocating, also votes for
        whoever asks it in that term), then claims the term with what it got; crash_first: once
        the coordinator crashed and its lease ran out, when the voters grant."""
        sim, me = self.sim, self.sim.ids[self.liar]
        if crash_first:
            for k in sim.coordinators():
                sim.crash(k)
            sim.run_for(CFG.lease_s + 0.01)
        live = sim.live()
        if not live:
            return
        term = min(MAX_TERM, max(sim.node(k).term for k in live) + 1)
        applied = max(sim.disk_applied[k] for k in live)
        voters = tuple(sorted(set(sim.voters) | {me}))
        for k in live:
            sim.inject(self.liar, k, RequestVote(term, me, *applied, config_digest(voters)))
        sim.run_for(0.05)
        if equivocate:
            for src, m in list(sim.inbox[self.liar]):
                if isinstance(m, RequestVote) and m.term == term and src != self.liar:
                    sig = self.key.sign(vote_payload(term, m.candidate, m.config))
                    sim.inject(self.liar, src, Vote(term, True, term, sig))
        c = self._certificate(2, term, me)
        for k in live:
            sim.inject(self.liar, k, Heartbeat(term, me, 1, *applied, c))
        sim.run_for(0.05)
        sim.offer(self.liar, term, 1, voters, c)

    @rule(up=st.sampled_from([1, 2, 1024, 2**62]), restart=st.integers(0, 8))
    def mint(self, up, restart):
        """The liar mints identities and certifies itself over the swarm's voters, itself and
        them, at any term: heartbeats, passed-on certificates and allocations whose council is a
        root of its own making or the swarm's with a change it signs. A restarted node that lost
        its council (a joiner) is offered the same. Nobody follows, takes the term, or a
        council with a minted voter."""
        sim, me = self.sim, self.sim.ids[self.liar]
        k = self._k(restart)
        if sim.nodes[k] is not None and k != self.liar:  # a joiner: a node that comes back with no council
            sim.crash(k)
            sim.disk_council[k] = None
            sim.disk_applied[k] = (0, 0)
            self.applied_before[k] = (0, 0)
            sim.restart(k)
        live = [j for j in sim.live() if j != self.liar]
        if not live:
            return
        term = min(MAX_TERM, max(sim.node(j).term for j in live) + up)
        c = self._certificate(3, term, me)
        for j in live:
            sim.inject(self.liar, j, Heartbeat(term, me, 1, term, 1, c))
            sim.run_for(0.01)
            if sim.nodes[j] is not None:
                sim.nodes[j].learn(c, sim.local_now(j))
        own = Council(b"", tuple(sorted({me} | MINTED_IDS))[:7], 0, 7)
        sim.offer(self.liar, term, 1, own, c)
        honest = next((sim.node(j).council for j in live if sim.nodes[j] is not None and sim.node(j).council), None)
        if honest is not None and len(honest.voters) < 7:
            after = tuple(sorted(set(honest.voters) | {MINTED_IDS_SORTED[0]}))
            sig = self.key.sign(link_payload(term, 1, c.voters, after))
            try:
                forged = Council(honest.root, honest.root_voters, honest.root_at_ms, honest.size,
                                 (*honest.links, CouncilLink(c, after, sig, 1)))
            except ValueError:
                forged = None
            if forged is not None:
                sim.offer(self.liar, term, 1, forged, c)
        sim.run_for(0.05)
        for j in live:
            node = sim.nodes[j]
            if node is not None:
                assert node.coordinator != me or self.sim.ids[self.liar] in sim.voters, "followed a self-made certificate"
                assert not MINTED_IDS & set(node.voters), f"node {j} took a council with minted voters"

    @rule(i=st.integers(0, 8), j=st.integers(0, 8))
    def rival_candidates(self, i, j):
        """Two honest voters stand at once, the liar granting both (`split_vote`)."""
        split_vote(self.sim, self.liar, [self._k(i), self._k(j)])

    _LIE = st.tuples(st.integers(0, 6), st.integers(0, 8), st.integers(0, 8), st.sampled_from([0, 1, 2, 1025]),
                     st.booleans(), st.booleans(), st.integers(0, 2), st.integers(0, 9))

    @rule(lies=st.lists(_LIE, min_size=1, max_size=12))
    def lie(self, lies):
        for one in lies:
            self._lie(*one)
        self.sim.run_for(0.05)

    def _lie(self, kind, dst, pick, up, huge, flag, how, seq):
        sim, me = self.sim, self.sim.ids[self.liar]
        dst = dst % sim.n
        if dst == self.liar:
            return
        target = sim.nodes[dst]
        base = target.term if target is not None else 0
        term = MAX_TERM - (up % 3) if huge else max(1, base + up)
        other = sim.ids[pick % sim.n]
        digest = config_digest(target.voters) if target is not None and target.voters else bytes(32)
        if kind == 0:
            msg = PreVote(term, me, seq, seq)
        elif kind == 1:
            msg = PreVoteReply(term, flag, term if flag else MAX_TERM)
        elif kind == 2:
            msg = RequestVote(term, me, seq, seq, digest)
        elif kind == 3:  # a vote: its own true signature for the destination, or another's bytes
            sig = self.key.sign(vote_payload(term, sim.ids[dst], digest)) if flag else bytes(64)
            msg = Vote(term, True, term, sig) if how else Vote(term, False, MAX_TERM, b"")
        elif kind == 4:
            c = self._certificate(how, term, me)
            msg = Heartbeat(term, c.candidate, seq, seq, seq, c) if c.candidate == me else None
        elif kind == 5:
            msg = HeartbeatAck(term, seq, flag, seq, seq)
        else:  # an allocation, certified as well as it can
            c = self._certificate(how, term, me if flag else other)
            sim.offer(self.liar, term, base + seq + 1, tuple(sorted(set(sim.voters) | {me})), c)
            return
        if msg is not None:
            sim.inject(self.liar, dst, msg)

    @rule()
    def hand_out(self):
        """Every node that believes it is coordinator applies and offers its next allocation."""
        sim = self.sim
        for k in sim.coordinators():
            node = sim.node(k)
            sim.offer(k, node.term, node.last_applied[1] + 1, node.voters, node.certificate)

    @rule(i=st.integers(0, 8))
    def campaign(self, i):
        self.sim.campaign(self._k(i))

    @invariant()
    def safe(self):
        if self.sim is None:
            return
        assert self.sim.violations == []
        # strictly one coordinator per term, the liar's equivocation included (the simulation's
        # own check would tolerate two beyond the quorum's bound, which these runs never reach)
        elected = Counter(t for t, _ in self.sim.certificates)
        assert all(n == 1 for n in elected.values()), elected
        for k in range(self.sim.n):
            assert self.sim.disk_applied[k] >= self.applied_before[k]
        self.applied_before = list(self.sim.disk_applied)


TestByzantineElection = ByzantineElection.TestCase
TestByzantineElection.settings = settings(max_examples=examples(100), stateful_step_count=30, deadline=None, derandomize=True,
                                          suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------- the protocol under faults


class ElectionMachine(SimFaults):
    """Five or so nodes on a simulated network, under every move the network can make, handing
    out allocations that every node's epoch machine accepts or refuses."""

    def __init__(self):
        super().__init__()
        self.sim = None

    @initialize(n=st.integers(3, 6), seed=st.integers(0, 2**32), pre_vote=st.booleans())
    def start(self, n, seed, pre_vote):
        cfg = CFG if pre_vote else PLAIN
        self.sim = PlaneSim(n, cfg, seed=seed, conditions=NetConditions(jitter=1.0))
        self.sim.run_for(2.0)  # the first coordinator
        self.applied_before = [(0, 0)] * n


    @rule()
    def settle(self):
        """Heal, restart everyone, a clean network for a while: elections and hand-outs go through."""
        self.sim.heal()
        self.sim.net = NetConditions(jitter=1.0)
        for k in range(self.sim.n):
            self.sim.restart(k)
        self.sim.run_for(3.0)
        for k in self.sim.coordinators():
            self.sim.issue(k)
        self.sim.run_for(0.5)


    @rule(i=st.integers(0, 8))
    def issue(self, i):
        """Every node that believes it is coordinator hands out its next allocation."""
        for k in self.sim.coordinators():
            self.sim.issue(k)

    @rule(i=st.integers(0, 8))
    def issue_rogue(self, i):
        """A node that is not coordinator hands out one anyway, as a faulty peer would."""
        self.sim.issue(self._k(i), rogue=True)

    @rule(i=st.integers(0, 8))
    def campaign(self, i):
        self.sim.campaign(self._k(i))

    @invariant()
    def safe(self):
        assert self.sim.violations == []
        # one coordinator per term among the live nodes too (the sim checks every election)
        terms = [self.sim.nodes[k].term for k in self.sim.coordinators()]
        assert len(terms) == len(set(terms))
        for k in range(self.sim.n):
            assert self.sim.disk_applied[k] >= self.applied_before[k]
        self.applied_before = list(self.sim.disk_applied)


TestElectionMachine = ElectionMachine.TestCase
# derandomize: the same runs every time, so a failure reproduces
TestElectionMachine.settings = settings(max_examples=30, stateful_step_count=25, deadline=None, derandomize=True,
                                        suppress_health_check=[HealthCheck.too_slow])


def test_the_simulation_elects_applies_and_its_checks_fire():
    sim = PlaneSim(5, CFG, seed=1)
    sim.run_for(3.0)
    [c] = sim.coordinators()
    term = sim.nodes[c].term
    assert sim.violations == [] and sim.issue(c)
    sim.run_for(0.5)
    assert sim.disk_applied == [(term, 1)] * 5
    # a node whose store lost its vote votes again in the same term: the simulation sees it
    k = next(k for k in range(5) if k != c and sim.votes.get((k, term)) == sim.ids[c])
    other = next(j for j in range(5) if j not in (k, c))
    sim.crash(k)
    sim.stores[k].persist(0, None)
    sim.restart(k)
    sim._run(k, sim.nodes[k].handle(sim.ids[other], RequestVote(term, sim.ids[other], 9, 9,
                                                                 config_digest(sim.nodes[k].voters)), sim.now))
    assert [v.split(": ", 1)[1] for v in sim.violations] == [f"node {k} voted twice in term {term}"]
    # a vote sent before it was persisted, and a second coordinator of a term
    sim._run(k, [ElectionSend(sim.ids[other], Vote(term + 5, True, term + 5, bytes(64)))])
    sim._run(other, [BecameCoordinator(term)])
    assert len(sim.violations) == 4  # not persisted; two coordinators; elected without a certificate


@pytest.mark.parametrize("n, other_side_elects", [(6, True), (5, False)])
def test_a_side_without_a_quorum_never_elects(n, other_side_elects):
    """2 | n - 2: the side of the coordinator steps down; the other elects with a quorum (4 of 6),
    but not with a bare majority of an odd count (3 of 5: the quorum is 4, the price of
    tolerating a lying voter)."""
    sim = ElectionSim(n, CFG, seed=2)
    sim.run_for(3.0)
    c = sim.coordinators()[0]
    minority = [c, (c + 1) % n]
    sim.partition([1 if k in minority else 0 for k in range(n)])
    wins = len(sim.wins)
    sim.run_for(20.0)
    assert sim.violations == []
    assert c not in sim.coordinators()  # stepped down: no acks from a quorum
    assert all(k not in minority for _, k, _ in sim.wins[wins:])
    assert (len(sim.wins) > wins) is other_side_elects
    sim.heal()
    sim.run_for(5.0)
    assert len(sim.coordinators()) == 1 and sim.violations == []


# ---------------------------------------------------------------------- figures


def test_takeover_after_crashes_within_the_bounds():
    """100 coordinator crashes, 5 to 9 nodes on the worldwide scenario's delays (bench/election.py
    runs 1,000): median <= 2 and worst <= 3.5 minimum election timeouts."""
    cfg = ElectionConfig.wan()
    times = []
    for trial in range(10):
        t, sim = takeover_times(cfg, 5 + trial % 5, 10, seed=trial)
        assert sim.violations == []
        times += t
    x = [t / cfg.election_timeout_min_s for t in times]
    assert len(x) == 100
    assert statistics.median(x) <= 2.0
    assert max(x) <= 3.5


@pytest.mark.parametrize("inflate", [0, 5])
def test_a_returning_peer_changes_no_coordinator(inflate):
    cfg = ElectionConfig.wan()
    for seed in range(4):
        r = returning_peer(cfg, 5 + seed, seed=seed, away_s=20.0, inflate_terms=inflate)
        assert r["violations"] == []
        assert not r["deposed"] and not r["changed"]
        assert r["stood_again"] is bool(inflate)  # a voter ahead: the same coordinator, one term higher


def test_plain_raft_is_deposed_by_a_returning_peer():
    """The baseline: without pre-vote the cut-off peer raised its term and deposes the coordinator."""
    cfg = ElectionConfig.wan().with_(pre_vote=False, check_quorum=False)
    r = returning_peer(cfg, 5, seed=0, away_s=20.0)
    assert r["returned_term_ahead"] > 0 and r["deposed"]
