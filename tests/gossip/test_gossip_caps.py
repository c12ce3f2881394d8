"""Confirmed members capped per address group (security review 2026-11-28, N5: one process at
one address answering pings on 150 ports made 132 confirmed members), against the sans-IO
membership:

- a group (an IPv4 address, an IPv6 /64 and its /48, every loopback address together) holds
  at most its cap of live confirmed members, however many identities answer at it, and a
  member cannot leave its group by claiming another address or come back over the cap;
- a one-host test swarm of 64 daemons on 127.0.0.1 still fits;
- a full table takes an honest joiner whether it is full of unconfirmed fakes or of
  confirmed sybils, evicting in order: gone, unconfirmed of the largest arrival group,
  confirmed of the most populous group; never ourselves or a protected member;
- what a peer passes on (broadcasts, push-pull, the table a joiner bootstraps from) holds
  only members it confirmed, so within its caps.
"""

import random

import pytest

from dtfm.gossip.admission import LOOPBACK_GROUP, address_group, member_groups
from dtfm.gossip.claims import Claim
from dtfm.gossip.config import GossipConfig
from dtfm.gossip.members import MemberState
from dtfm.gossip.messages import Gossip, PushPull
from dtfm.gossip.status import gossip_status
from dtfm.gossip.swim import Swim
from dtfm.gossip.view import build_view
from dtfm.net import Identity
from verifying import answer_verifications

CFG = GossipConfig.lan()
ALIVE, LEFT = MemberState.ALIVE, MemberState.LEFT
CAP = "address group at its cap of members"
SYBIL_HOST = "203.0.113.9"


def identities(n, seed):
    rng = random.Random(seed)
    return [Identity(rng.randbytes(32)) for _ in range(n)]


HONEST = identities(4, seed=1)
ME, HONEST_IDS = HONEST[0], [i.peer_id for i in HONEST[1:]]


def honest_claim(k, host=None):
    return Claim.create(HONEST[k], 0, ALIVE, host or "10.0.0.%d" % (k + 1), 7000, "eu")


def victim(cfg=CFG, host="10.0.0.1"):
    """A member with three honest, confirmed members besides itself."""
    s = Swim(cfg, ME, honest_claim(0, host).member(), random.Random(1), 0.0)
    for k in (1, 2, 3):
        out = s.handle(HONEST[k].peer_id, PushPull((honest_claim(k),), reply=False), 0.0, origin="10.0.0.%d" % (k + 1))
        answer_verifications(s, out, 0.0)
    assert s.live_count() == 4
    return s


def introduce(s, ids, hosts, now, *, answer=True, origin=None):
    """Each identity pushes its own claim at its host from `origin` (default: that host) and,
    if `answer`, acks the verification pings (it listens there); the ids that count as alive."""
    for ident, host in zip(ids, hosts):
        out = s.handle(ident.peer_id, Gossip((Claim.create(ident, 0, ALIVE, host, 7000, ""),)), now,
                       origin=origin or host)
        if answer:
            answer_verifications(s, out, now, only={ident.peer_id})
    return [i.peer_id for i in ids if s.is_confirmed(i.peer_id) and i.peer_id in s.members]


# ---- grouping


def test_groups_of_an_address():
    assert member_groups("203.0.113.9") == (("203.0.113.9", member_groups("1.2.3.4")[0][1]),)
    v6 = [g for g, _ in member_groups("2001:db8:1:2::7")]
    assert v6 == ["2001:db8:1:2::/64", "2001:db8:1::/48"]
    assert member_groups("::ffff:203.0.113.9") == member_groups("203.0.113.9")
    # every loopback address is this host: one group, for the caps and for the admission rate
    for host in ("127.0.0.1", "127.0.0.2", "127.255.0.9", "::1", "::ffff:127.0.0.1", "localhost", "LocalHost.",
                 "x.localhost", "127.1", "0x7f000001", "0177.0.0.1"):
        assert address_group(host) == LOOPBACK_GROUP, host
    # other spellings a dial takes of one address are that address
    assert address_group("203.0.113.9") == address_group("203.0.28937") == address_group("0xcb.0.0x71.9")
    assert address_group("fe80::1%eth0") == address_group("fe80::1%eth1")
    assert address_group("mem3") == address_group("MEM3.") == "mem3"  # an in-memory network's host names


# ---- the cap


def test_a_group_holds_at_most_its_cap_however_many_identities_answer():
    cfg = CFG.with_(new_member_burst_per_address=1000)  # (the rate apart: this is about the number)
    s = victim(cfg)
    sybils = identities(150, seed=2)
    # 150 identities at one address, each on its own port and answering every ping (N5's attack)
    confirmed = introduce(s, sybils, [SYBIL_HOST] * 150, 1.0)
    assert len(confirmed) == cfg.max_members_per_address == 16
    assert s.live_count() == 4 + 16
    assert s.refused[CAP] == 150 - 16
    assert len(s.members) == 4 + 16  # the refused are not held either
    status = gossip_status(s.members.values(), s.is_confirmed, [], [], {}, lambda: build_view((), {}),
                           refused=s.refused, evicted=s.evicted)  # (dtfm-peer status, the metrics)
    assert status["refused"] == {CAP: 150 - 16} and status["evicted"] == 0
    # relayed by an honest member, or claimed again one incarnation up: still refused
    late = sybils[100]
    s.handle(HONEST_IDS[0], Gossip((Claim.create(late, 1, ALIVE, SYBIL_HOST, 7001, ""),)), 2.0, origin="10.0.0.2")
    assert late.peer_id not in s.members and s.refused[CAP] == 150 - 16 + 1
    # a sybil cannot leave its group by claiming another address (not checked again), so the
    # group stays full
    moved = identities(1, seed=2)[0]
    s.handle(moved.peer_id, Gossip((Claim.create(moved, 1, ALIVE, "198.51.100.1", 7000, ""),)), 3.0,
             origin="198.51.100.1")
    assert s.members[moved.peer_id].host == "198.51.100.1"
    assert introduce(s, identities(1, seed=3), [SYBIL_HOST], 3.0) == []
    # one that leaves makes room for another; it cannot come back over the cap
    s.handle(moved.peer_id, Gossip((Claim.create(moved, 2, LEFT, "198.51.100.1", 7000, ""),)), 4.0)
    newcomer = identities(1, seed=4)
    assert introduce(s, newcomer, [SYBIL_HOST], 4.0) == [newcomer[0].peer_id]
    s.handle(moved.peer_id, Gossip((Claim.create(moved, 3, ALIVE, "198.51.100.1", 7000, ""),)), 5.0)
    assert s.members[moved.peer_id].state == LEFT
    assert s.live_count() == 4 + 16
    # another address is another group
    assert len(introduce(s, identities(3, seed=5), ["203.0.113.10"] * 3, 6.0)) == 3


def test_ipv6_counts_per_64_and_per_48():
    cfg = CFG.with_(new_member_burst_per_address=1000)
    s = victim(cfg)
    # six /64s of one /48, 20 identities each: 16 per /64, 64 in the /48 (four /64s' worth)
    hosts = ["2001:db8:1:%x::%x" % (k, i + 1) for k in range(6) for i in range(20)]
    confirmed = introduce(s, identities(len(hosts), seed=6), hosts, 1.0)
    per64 = {}
    for p in confirmed:
        g = member_groups(s.members[p].host)[0][0]
        per64[g] = per64.get(g, 0) + 1
    assert len(confirmed) == cfg.max_members_per_ipv6_48 == 64
    assert max(per64.values()) == cfg.max_members_per_address
    # the next /48 is another site
    assert len(introduce(s, identities(5, seed=7), ["2001:db8:2::%x" % (i + 1) for i in range(5)], 2.0)) == 5


def test_a_one_host_test_swarm_of_64_daemons_fits_on_loopback():
    # dtfm-swarm runs its daemons on 127.0.0.1 (up to 64 in the scripted swarms): each sees
    # the other 63 confirmed; the loopback cap (this host) counts them all, ourselves apart
    cfg = CFG.with_(new_member_burst_per_address=1000)
    s = victim(cfg, host="127.0.0.1")
    others = identities(64, seed=8)
    confirmed = introduce(s, others, ["127.0.0.1"] * 64, 1.0)
    assert len(confirmed) == cfg.max_members_per_loopback == 64  # 64 others: a swarm of 65
    assert introduce(s, identities(1, seed=9), ["127.0.0.2"], 1.0) == []  # any loopback address is this host
    assert s.refused[CAP] == 1


# ---- a full table


def fill_unconfirmed(s, n, now, seed):
    """n fakes claimed at an address where nobody answers, pushed from one attacker address."""
    fakes = identities(n, seed)
    introduce(s, fakes, ["192.0.2.1"] * n, now, answer=False, origin=SYBIL_HOST)
    return [f.peer_id for f in fakes]


def test_a_table_full_of_unconfirmed_fakes_from_one_group_takes_an_honest_joiner():
    cfg = CFG.with_(max_members=128, new_member_burst_per_address=1000)
    s = victim(cfg)
    fakes = fill_unconfirmed(s, 200, 1.0, seed=10)
    assert len(s.members) == 128 and s.evicted == 200 - 124
    joiner = identities(1, seed=11)
    assert introduce(s, joiner, ["198.51.100.20"], 2.0) == [joiner[0].peer_id]
    assert len(s.members) == 128 and s.live_count() == 5
    assert sum(p in s.members for p in fakes) == 123  # it took a fake's place


def test_a_table_full_of_confirmed_sybils_from_one_group_takes_an_honest_joiner():
    # a cap as large as the table, so one group can fill it with members that answer
    cfg = CFG.with_(max_members=64, max_members_per_address=64, new_member_burst_per_address=1000)
    s = victim(cfg)
    sybils = introduce(s, identities(80, seed=12), [SYBIL_HOST] * 80, 1.0)
    assert len(sybils) == 60 and len(s.members) == 64 and s.live_count() == 64
    assert s.refused["member table full"] == 20
    # today's rule (no confirmed member is ever evicted) refused it; the most populous group
    # gives up its last confirmed member
    joiner = identities(1, seed=13)
    assert introduce(s, joiner, ["198.51.100.20"], 2.0) == [joiner[0].peer_id]
    assert sybils[-1] not in s.members and all(p in s.members for p in HONEST_IDS)
    assert s.live_count() == 64
    # more sybils from the same group find no place: their group is already the largest
    assert introduce(s, identities(3, seed=14), [SYBIL_HOST] * 3, 3.0) == []
    assert joiner[0].peer_id in s.members
    # a second honest joiner from another address gets in as well
    second = identities(1, seed=15)
    assert introduce(s, second, ["198.51.100.21"], 4.0) == [second[0].peer_id]


def test_a_table_full_of_confirmed_sybils_within_the_default_caps_takes_an_honest_joiner():
    cfg = CFG.with_(max_members=68, new_member_burst_per_address=1000)
    s = victim(cfg)
    hosts = ["203.0.113.%d" % (10 + k) for k in range(4) for _ in range(20)]
    sybils = introduce(s, identities(80, seed=16), hosts, 1.0)
    assert len(sybils) == 64 and len(s.members) == 68  # 16 per address, the cap
    joiner = identities(1, seed=17)
    assert introduce(s, joiner, ["198.51.100.20"], 2.0) == [joiner[0].peer_id]


def test_eviction_order_when_the_table_is_full():
    cfg = CFG.with_(max_members=13, new_member_burst_per_address=1000)
    s = victim(cfg)  # ourselves and 3 honest members, one per address
    sybils = introduce(s, identities(4, seed=18), [SYBIL_HOST] * 4, 1.0)  # one group of 4
    gone = identities(1, seed=19)[0]
    introduce(s, [gone], ["198.51.100.50"], 1.0)
    s.handle(gone.peer_id, Gossip((Claim.create(gone, 1, LEFT, "198.51.100.50", 7000, ""),)), 1.0)
    two = fill_unconfirmed(s, 2, 1.0, seed=20)  # two fakes came in from 203.0.113.9
    one = identities(1, seed=21)
    introduce(s, one, ["192.0.2.7"], 1.0, answer=False, origin="198.51.100.77")
    protected = introduce(s, identities(1, seed=22), [SYBIL_HOST], 1.0)  # a fifth sybil the allocation names
    s.protected = set(protected).__contains__
    assert len(s.members) == 13
    evicted = []

    def join(k):
        before = set(s.members)
        ident = identities(1, seed=100 + k)
        got = introduce(s, ident, ["198.51.100.%d" % (100 + k)], 2.0 + k)
        evicted.extend(before - set(s.members))
        return got == [ident[0].peer_id]

    assert all(join(k) for k in range(8))
    # gone first; then unconfirmed, from the group most came in from; then confirmed
    # members of the most populous group, the last confirmed first (the protected one stays)
    assert evicted == [gone.peer_id, two[0], two[1], one[0].peer_id, sybils[3], sybils[2], sybils[1], sybils[0]]
    # the sybils' group now holds one (protected): no group holds more than a newcomer's
    assert not join(8) and s.refused["member table full"] == 1
    assert ME.peer_id in s.members and all(p in s.members for p in HONEST_IDS + protected)


# ---- what a peer passes on


def test_unconfirmed_members_are_not_passed_on_and_a_joiner_inherits_only_confirmed_ones():
    cfg = CFG.with_(new_member_burst_per_address=1000, push_pull_interval_s=0.0)
    seed = victim(cfg)
    sybils = introduce(seed, identities(40, seed=24), [SYBIL_HOST] * 40, 1.0)
    fakes = fill_unconfirmed(seed, 300, 1.0, seed=23)
    assert len(sybils) == 16 and len(seed.members) == 4 + 16 + 300
    # broadcasts: the claims of confirmed members only
    queued = {u.subject for u in seed.broadcasts.take(1 << 20, 1 << 20)}
    assert queued == {ME.peer_id, *HONEST_IDS, *sybils}
    # a joiner bootstrapping through the flooded seed gets only what it confirmed
    joiner = Swim(cfg, HONEST[1], honest_claim(1).member(), random.Random(2), 2.0)
    [req] = joiner.add_seed(ME.peer_id, ("10.0.0.1", 7000), 2.0, origin="10.0.0.1")
    handed = set()
    for x in seed.handle(HONEST_IDS[0], req.msg, 2.0, origin="10.0.0.2"):
        if isinstance(x.msg, PushPull):
            handed |= {u.subject for u in x.msg.updates}
            joiner.handle(ME.peer_id, x.msg, 2.1, origin="10.0.0.1")
    assert handed == {ME.peer_id, *HONEST_IDS, *sybils}
    assert not set(fakes) & set(joiner.members)
    assert len(joiner.members) == 4 + 16


@pytest.mark.parametrize("field", ["max_members_per_address", "max_members_per_ipv6_48", "max_members_per_loopback"])
def test_caps_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        CFG.with_(**{field: 0})
