"""Hostile members against the SWIM membership: forged claims and accusations, inflated
incarnations, replays, floods of fake members. Mostly sans-IO on the state machine; the last
tests run whole services over the in-memory network under MockClock."""

import dataclasses
import random

import pytest
import trio

from dtfm.gossip.claims import Accusation, Claim
from dtfm.gossip.config import GossipConfig
from dtfm.gossip.harness import Harness
from dtfm.gossip.members import MAX_INCARNATION, Member, MemberState
from dtfm.gossip.messages import Gossip, MsgType, Ping, PingReq, PushPull, decode_swim
from dtfm.gossip.swim import Swim
from dtfm.net import Identity, pack, unpack_untrusted
from verifying import answer_verifications

CFG = GossipConfig.lan()
KEYS = {i.peer_id: i for i in (Identity(bytes([k + 1]) * 32) for k in range(12))}
PIDS = list(KEYS)
H, M, V, W, X = PIDS[:5]  # H observes, M is malicious, V is its victim, W and X are honest
ALIVE, SUSPECT, DEAD, LEFT = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD, MemberState.LEFT


def claim(pid, inc=0, state=ALIVE, host=None, key=None):
    return Claim.create(key or KEYS[pid], inc, state, host or "10.0.0.%d" % (PIDS.index(pid) + 1), 7000, "r")


def forged_claim(pid, inc, state, signer):
    """A claim about pid signed with someone else's key."""
    unsigned = Claim(pid, inc, state, "6.6.6.6", 666, "r")
    return Claim(pid, inc, state, "6.6.6.6", 666, "r", KEYS[signer].sign(unsigned.signing_bytes()))


def accuse(by, of, inc=0, state=SUSPECT):
    return Accusation.create(KEYS[by], of, inc, state)


def forged_accusation(named, of, inc, state, signer):
    unsigned = Accusation(named, of, inc, state)
    return Accusation(named, of, inc, state, KEYS[signer].sign(unsigned.signing_bytes()))


def node(pid=H, others=(M, V, W, X), cfg=CFG, now=0.0):
    s = Swim(cfg, KEYS[pid], claim(pid).member(), random.Random(1), now)
    for o in others:
        answer_verifications(s, s.handle(o, PushPull((claim(o),), reply=False), now), now)
    s.drain_changes()
    return s


def gossip(s, src, *updates, now=1.0):
    return s.handle(src, Gossip(tuple(updates)), now)


def sybils(n, seed=0):
    rng = random.Random(seed)
    return [Identity(rng.randbytes(32)) for _ in range(n)]


# ---- forged claims and accusations


def test_forged_claims_about_another_peer_are_refused():
    s = node()
    for state in (ALIVE, LEFT):
        for inc in (0, 1, MAX_INCARNATION):
            gossip(s, M, forged_claim(V, inc, state, signer=M))
    assert s.members[V] == claim(V).member()
    # (the inflated ones fail the cheaper check first)
    assert s.refused == {"bad signature": 4, "incarnation jump too large": 2}
    # the same as a new member: nobody is admitted on a forged claim
    stranger = sybils(1)[0].peer_id
    gossip(s, M, forged_claim(stranger, 0, ALIVE, signer=M))
    assert stranger not in s.members and s.refused["bad signature"] == 5


def test_forged_accuser_is_refused_and_no_suspicion_starts():
    s = node()
    for state in (SUSPECT, DEAD):
        gossip(s, M, forged_accusation(W, V, 0, state, signer=M))  # M signs in W's name
    assert s.members[V].state == ALIVE and V not in s.suspicions
    assert s.refused == {"bad signature": 2}


def test_accuser_must_be_a_member():
    s = node()
    outsider = sybils(1)[0]
    gossip(s, M, Accusation.create(outsider, V, 0, SUSPECT))
    assert s.members[V].state == ALIVE and s.refused == {"accuser is not a member": 1}


def test_incarnation_inflation_is_refused_and_the_victim_can_always_refute():
    # the attack that used to stick: (victim, 2^63 - 1, left) outranked every claim of the victim
    s = node()
    gossip(s, M, forged_claim(V, MAX_INCARNATION, LEFT, signer=M))
    gossip(s, M, forged_claim(V, CFG.max_incarnation_jump, LEFT, signer=M))
    gossip(s, M, accuse(M, V, MAX_INCARNATION, DEAD))  # signed by M, of an incarnation V never claimed
    assert s.members[V] == claim(V).member()
    assert s.refused == {"incarnation jump too large": 1, "bad signature": 1,
                         "accuses an incarnation never claimed": 1}
    # a genuine claim may not jump further than max_incarnation_jump either
    gossip(s, V, claim(V, CFG.max_incarnation_jump + 1))
    assert s.members[V].incarnation == 0 and s.refused["incarnation jump too large"] == 2
    gossip(s, V, claim(V, CFG.max_incarnation_jump))
    assert s.members[V].incarnation == CFG.max_incarnation_jump
    # the victim itself ignores accusations of incarnations it never claimed, and refutes the
    # ones of its current incarnation with +1
    v = node(V, others=(H, M, W, X))
    gossip(v, M, accuse(M, V, MAX_INCARNATION, DEAD), accuse(M, V, 7, DEAD))
    assert v.me.incarnation == 0
    gossip(v, M, accuse(M, V, 0, DEAD))
    assert v.me.incarnation == 1 and v.me.state == ALIVE


def test_refuting_at_the_largest_incarnation_is_skipped_not_a_crash():
    v = node(V, others=(H, M))
    gossip(v, V, claim(V, MAX_INCARNATION))  # its own claim of an earlier life (it signed it)
    assert v.me.incarnation == 0
    assert v.handle(M, Ping(3, V), 2.0)[0].msg.seq == 3  # the rest of the message is still handled


def test_one_accuser_cannot_kill_and_the_victim_refutes_each_time():
    s = node()
    t = 1.0
    for inc in range(5):
        gossip(s, M, accuse(M, V, inc, DEAD), now=t)
        assert s.members[V].state == SUSPECT  # a dead accusation from someone else: a suspicion
        assert s.suspicions[V].deadline == pytest.approx(t + CFG.suspicion_max_s(5), abs=1e-3)
        gossip(s, M, accuse(M, V, inc, DEAD), accuse(M, V, inc, SUSPECT), now=t + 0.5)
        assert len(s.suspicions[V].confirmers) == 1  # repeating it confirms nothing
        gossip(s, V, claim(V, inc + 1), now=t + 1.0)  # the victim hears it and refutes
        assert s.members[V].state == ALIVE and V not in s.suspicions
        t += 2.0
    assert all(st != DEAD for st in [m.state for m in s.drain_changes()])


def test_confirmations_count_distinct_verified_member_accusers():
    cfg = CFG.with_(suspicion_mult=5.0)  # k = 3 confirmations expected
    s = node(others=PIDS[1:10], cfg=cfg)
    n = s.live_count()
    lo, hi = cfg.suspicion_min_s(n), cfg.suspicion_max_s(n)
    gossip(s, W, accuse(W, V), now=0.0)
    assert s.suspicions[V].deadline == pytest.approx(hi, abs=1e-3)
    # a forged confirmation, sybils that are not members, and W again: no change
    gossip(s, M, forged_accusation(X, V, 0, SUSPECT, signer=M), now=1.0)
    gossip(s, M, *(Accusation.create(k, V, 0, SUSPECT) for k in sybils(3)), now=1.0)
    gossip(s, W, accuse(W, V, 0, DEAD), now=1.0)
    assert s.suspicions[V].confirmers == {W}
    assert s.suspicions[V].deadline == pytest.approx(hi, abs=1e-3)
    # three distinct members confirm: the suspicion falls to its minimum
    gossip(s, X, accuse(X, V), accuse(PIDS[5], V), accuse(PIDS[6], V, 0, DEAD), now=1.0)
    assert s.suspicions[V].confirmers == {W, X, PIDS[5], PIDS[6]}
    assert s.suspicions[V].deadline == pytest.approx(lo, abs=1e-3)
    s.tick(lo)
    assert s.members[V].state == DEAD
    ours = s.table.entries[V].accusation
    assert ours.accuser == H and ours.state == DEAD and ours.verify()


# ---- replays and verification cost


def test_replayed_old_claims_and_accusations_change_nothing_and_cost_no_verification():
    s = node()
    old_alive, old_left = claim(V, 0), claim(V, 1, LEFT)
    gossip(s, W, accuse(W, V, 0))
    gossip(s, V, claim(V, 2), now=2.0)  # refuted twice meanwhile (a restart, say)
    checks = s.verifier.checks
    gossip(s, M, old_alive, old_left, claim(V, 1), accuse(W, V, 0), accuse(M, V, 1, DEAD), now=3.0)
    assert s.members[V] == claim(V, 2).member()
    assert s.verifier.checks == checks  # older than held: dropped before any signature check


def test_a_relayed_update_is_verified_once():
    s = node()
    c = claim(V, 1)
    checks = s.verifier.checks
    for src in (M, W, X, V, M):
        gossip(s, src, c)
    assert s.verifier.checks == checks + 1


# ---- floods


def test_push_pull_flood_of_fake_members_is_rate_limited_per_source():
    s = node()
    fakes = [Claim.create(k, 0, ALIVE, "198.51.100.7", 1 + i, "") for i, k in enumerate(sybils(3000))]
    for i in range(0, len(fakes), 1000):  # pages of a push-pull
        s.handle(M, PushPull(tuple(fakes[i:i + 1000]), reply=i == 0), 0.0)
    burst = CFG.new_member_burst
    assert len(s.members) == 5 + burst
    assert s.refused == {"source over its rate of new members": 3000 - burst}
    # the bucket refills at new_members_per_s: ten seconds later, ten more
    s.handle(M, PushPull(tuple(fakes[burst:]), reply=False), 10.0)
    assert len(s.members) == 5 + burst + int(10 * CFG.new_members_per_s)
    # another source is not held back by M's flood, and a member introducing itself never is
    newcomer = sybils(1, seed=9)[0]
    s.handle(W, Gossip((Claim.create(newcomer, 0, ALIVE, "10.0.0.99", 7000, "r"),)), 10.0)
    own = Claim.create(sybils(1, seed=8)[0], 0, ALIVE, "10.0.0.98", 7000, "r")
    s.handle(own.peer_id, Gossip((own,)), 10.0)
    assert newcomer.peer_id in s.members and own.peer_id in s.members
    # the honest members' view is untouched
    assert all(s.members[p] == claim(p).member() for p in (M, V, W, X))


def test_the_peer_we_join_through_hands_us_the_whole_swarm_once():
    big = sybils(300, seed=3)
    seed = node(V, others=())
    for i, k in enumerate(big):  # 300 members, each at an address of its own, verified by the seed
        out = seed.handle(k.peer_id, PushPull((Claim.create(k, 0, ALIVE, "10.1.%d.%d" % divmod(i, 256), 7000, ""),),
                                              reply=False), 0.0)
        answer_verifications(seed, out, 0.0)
    assert seed.live_count() == 301
    joiner = node(H, others=())
    sends = joiner.add_seed(V, ("10.0.0.3", 7000), 1.0, origin="10.0.0.3")
    [req] = sends
    reply = [x for x in seed.handle(H, req.msg, 1.0) if isinstance(x.msg, PushPull)]
    verifying = []
    for page in reply:
        msg = decode_swim(MsgType.PUSH_PULL, unpack_untrusted(pack(page.msg.to_wire()), max_len=1 << 20))
        verifying += [x for x in joiner.handle(V, msg, 1.1, origin="10.0.0.3") if x.dial]
    assert len(joiner.members) == 302 and not joiner.refused  # past both bursts: the seed's grant
    # none counts as alive before it answers at its address; a few are verified at a time
    assert joiner.live_count() == 1 and len(verifying) == CFG.max_verifying
    # only while we join: later the seed is an ordinary source, at an ordinary address
    more = [Claim.create(k, 0, ALIVE, "10.1.0.2", 7000, "") for k in sybils(100, seed=4)]
    joiner.handle(V, PushPull(tuple(more), reply=False), 1.0 + 10 * CFG.probe_interval_s + 0.1, origin="10.0.0.3")
    assert len(joiner.members) == 302 + CFG.new_member_burst


def test_full_state_goes_in_pages_that_each_fit_and_decode():
    cfg = CFG.with_(max_push_pull_bytes=4096, new_member_burst=10_000)
    s = node(cfg=cfg)
    for i, k in enumerate(sybils(500, seed=5)):  # (push-pull carries confirmed members: these are)
        out = s.handle(M, Gossip((Claim.create(k, 0, ALIVE, "10.2.%d.%d" % divmod(i, 256), 7000, "region"),)), 0.0)
        answer_verifications(s, out, 0.0)
    s.handle(W, Gossip((accuse(W, V),)), 0.0)
    sends = s.handle(X, PushPull((claim(X),), reply=True), 0.0)
    assert len(sends) > 10
    assert [x.msg.reply for x in sends] == [False] * len(sends)
    got = []
    for x in sends:
        data = pack(x.msg.to_wire())
        assert len(data) <= cfg.max_push_pull_bytes
        got += decode_swim(MsgType.PUSH_PULL, unpack_untrusted(data, max_len=1 << 20)).updates
    assert got[0] == s.table.entries[H].claim  # our own claim first
    assert isinstance(got[-1], Accusation)  # accusations after every claim
    assert len(got) == len(s.members) + 1


def test_a_full_table_makes_room_from_unconfirmed_members_only():
    cfg = CFG.with_(max_members=8)
    s = node(cfg=cfg)  # 5 confirmed members
    fakes = [Claim.create(k, 0, ALIVE, "10.3.0.1", 7000, "") for k in sybils(10, seed=6)]
    s.handle(M, PushPull(tuple(fakes), reply=False), 0.0)
    # the table is full after 3; each later fake takes the place of the longest-held fake
    assert len(s.members) == 8 and s.evicted == 7 and not s.refused
    assert set(s.members) == set(PIDS[:5]) | {c.peer_id for c in fakes[7:]}
    # members the allocation names are never taken out, however unconfirmed: no room left
    held = {c.peer_id for c in fakes[7:]}
    s.protected = held.__contains__
    more = [Claim.create(k, 0, ALIVE, "10.3.0.2", 7000, "") for k in sybils(2, seed=16)]
    s.handle(W, PushPull(tuple(more), reply=False), 0.0)
    assert s.refused == {"member table full": 2} and set(s.members) == set(PIDS[:5]) | held
    gossip(s, V, claim(V, 1))  # known members still update
    assert s.members[V].incarnation == 1
    assert s.handle(W, PushPull((claim(W),), reply=True), 2.0)  # and push-pull still answers
    # a dead member goes first (its tombstone stays), before any unconfirmed one
    s.protected = lambda pid: False
    gossip(s, V, claim(V, 2, LEFT), now=3.0)
    late = Claim.create(sybils(1, seed=17)[0], 0, ALIVE, "10.3.0.3", 7000, "")
    gossip(s, X, late, now=3.0)
    assert V not in s.members and late.peer_id in s.members and s.table.tombstone(V) == claim(V, 2, LEFT)


def test_ping_req_about_a_non_member_is_not_relayed():
    s = node()
    assert s.handle(M, PingReq(1, sybils(1)[0].peer_id), 1.0) == []
    [ping] = s.handle(M, PingReq(2, V), 1.0)
    assert ping.to == V and ping.address == ("10.0.0.3", 7000)


# ---- reaping and tombstones


def test_gone_members_are_reaped_and_their_old_claims_refused():
    cfg = CFG.with_(push_pull_interval_s=0.0)
    s = node(cfg=cfg)
    gossip(s, V, claim(V, 0, LEFT), now=10.0)
    gossip(s, W, claim(W, 3, LEFT), now=20.0)
    s.tick(10.0 + cfg.reap_after_s - 0.001)
    assert V in s.members
    s.tick(10.0 + cfg.reap_after_s)
    assert V not in s.members and W in s.members and s.live_count() == 3
    s.tick(20.0 + cfg.reap_after_s)
    assert W not in s.members
    # a replay of an older claim does not bring them back
    gossip(s, M, claim(V, 0), claim(W, 2), now=200.0)
    assert V not in s.members and W not in s.members
    assert s.refused == {"not newer than the claim of a removed member": 2}
    # V restarts at incarnation 0 and push-pulls: it is sent its last claim, refutes above it,
    # and its new claim is taken
    v = node(V, others=())
    [req] = v.add_seed(H, ("10.0.0.1", 7000), 210.0)
    reply = s.handle(V, req.msg, 210.0)
    assert reply[0].msg.updates[0] == claim(V, 0, LEFT)
    for x in reply:
        v.handle(H, x.msg, 210.1)
    assert v.me.incarnation == 1 and v.me.state == ALIVE
    s.handle(V, Gossip((v.table.entries[V].claim,)), 210.2)
    assert s.members[V].state == ALIVE and s.members[V].incarnation == 1
    # after tombstone_s the tombstone itself goes
    s.tick(20.0 + cfg.reap_after_s + cfg.tombstone_s)
    assert s.table.tombstone(W) is None


def test_a_long_churn_keeps_the_table_and_push_pull_bounded():
    # 5,000 peers join and leave over ~14 hours: the table holds the recent ones only, and a
    # push-pull stays a handful of pages (it used to fail once 4,096 entries had accumulated)
    cfg = CFG.with_(push_pull_interval_s=0.0)
    s = node(cfg=cfg)
    t = 0.0
    for k in sybils(5000, seed=7):
        t += 10.0
        s.handle(k.peer_id, Gossip((Claim.create(k, 0, ALIVE, "10.4.0.1", 7000, ""),)), t)
        s.handle(k.peer_id, Gossip((Claim.create(k, 0, LEFT, "10.4.0.1", 7000, ""),)), t + 5.0)
        s.tick(t + 5.0)
    assert len(s.members) <= 5 + cfg.reap_after_s / 10.0 + 1
    assert s.table.tombstone_count() <= cfg.tombstone_s / 10.0 + 1
    # (W, never answering our probes here, was found dead and reaped long ago: its claim
    # brings it back, unconfirmed, and we verify it)
    assert len([x for x in s.handle(W, PushPull((claim(W),), reply=True), t + 6.0) if not x.dial]) == 1


# ---- over the in-memory network


async def wait_for(pred, limit_s, step_s=0.5):
    with trio.fail_after(limit_s):
        while not pred():
            await trio.sleep(step_s)
    return trio.current_time()


async def test_hostile_member_over_the_network_leaves_the_honest_view_intact(autojump_clock):
    cfg = GossipConfig.test()
    async with trio.open_nursery() as nursery:
        h = Harness(6, cfg, seed=11)
        await h.start(nursery)
        await wait_for(h.all_know_all, 20)
        bad, victim = 5, 1
        forged = Claim(h.ids[victim], MAX_INCARNATION, LEFT, "6.6.6.6", 666, "")
        forged = dataclasses.replace(forged, signature=h.identities[bad].sign(forged.signing_bytes()))
        inflated = Accusation.create(h.identities[bad], h.ids[victim], MAX_INCARNATION, DEAD)
        named = Accusation(h.ids[2], h.ids[victim], 0, DEAD)
        named = dataclasses.replace(named, signature=h.identities[bad].sign(named.signing_bytes()))
        fakes = [Claim.create(k, 0, ALIVE, "198.51.100.7", 1000 + i, "") for i, k in enumerate(sybils(2000, seed=12))]
        for k in range(5):
            conn = await h.transports[bad].connect(*h.transports[k].listen_address)
            await conn.send(MsgType.GOSSIP, Gossip((forged, inflated, named)).to_wire())
            for i in range(0, len(fakes), 200):
                await conn.send(MsgType.PUSH_PULL, PushPull(tuple(fakes[i:i + 200]), reply=False).to_wire())
        await trio.sleep(1.0)
        for k in range(5):
            swim = h.services[k].swim
            assert swim.members[h.ids[victim]].state == ALIVE
            assert swim.members[h.ids[victim]].incarnation == 0
            fake_count = len(swim.members) - 6
            assert fake_count <= cfg.new_member_burst + 1  # M's burst (the same fakes everywhere)
        # the fakes answer no probe: each is probed once its turn comes (a round over all
        # members), suspected, dead and reaped (a loose bound: twice that sum); no honest member died
        n = 6 + cfg.new_member_burst
        bound = 2 * (n * cfg.probe_interval_s + cfg.suspicion_max_s(n) + cfg.reap_after_s)
        await wait_for(lambda: all(len(h.services[k].swim.members) == 6 for k in range(6)), bound)
        honest = [(k, j) for k in range(6) for j in range(6) if j != k]
        assert all(h.first_time(k, j, DEAD) is None and h.state_seen(k, j) == ALIVE for k, j in honest)
        nursery.cancel_scope.cancel()
