"""The membership flood through throw-away identities (security review 2026-11-25, finding 9),
against the sans-IO membership: 72 fresh identities connect from one address and each pushes a
push-pull page of 64 validly self-signed claims of fake members at 127.0.0.9:9.

- admissions are bounded by the remote address (an IPv4 address, an IPv6 /64), a member's own
  claim included, whatever the number of identities;
- fakes never answer a ping at their address, so they never count as alive, and nobody can
  answer for them;
- a table filled with fakes still takes an honest joiner;
- the status of a flooded table fits one control frame.
"""

import random

import pytest

from dtfm.gossip.claims import Claim
from dtfm.gossip.config import GossipConfig
from dtfm.gossip.members import MAX_HOST_LEN, MAX_REGION_LEN, Member, MemberState
from dtfm.gossip.messages import Ack, Nack, Ping, PingReq, PushPull
from dtfm.gossip.records import Entry, Report
from dtfm.gossip.status import MAX_DISPUTED_LISTED, MAX_MEMBERS_LISTED, MAX_VIEW_PEERS, gossip_status
from dtfm.gossip.swim import Swim
from dtfm.gossip.view import build_view
from dtfm.net import Identity, pack
from dtfm.peer.control_client import encode_frame
from dtfm.peer.status import REPLY_OVERHEAD_BYTES, fit_report, format_text
from verifying import answer_verifications

CFG = GossipConfig.lan()
ALIVE = MemberState.ALIVE
ATTACKER_HOST = "203.0.113.9"
FAKE_ADDRESS = ("127.0.0.9", 9)  # nobody listens there
FRAME_BYTES = 4 * 1024 * 1024  # the control socket's default max_response_bytes


def identities(n, seed):
    rng = random.Random(seed)
    return [Identity(rng.randbytes(32)) for _ in range(n)]


HONEST = identities(4, seed=1)
ME, HONEST_IDS = HONEST[0], [i.peer_id for i in HONEST[1:]]


def honest_claim(k, inc=0):
    return Claim.create(HONEST[k], inc, ALIVE, "10.0.0.%d" % (k + 1), 7000, "eu")


def victim(cfg=CFG, now=0.0):
    """A member with three honest, confirmed members besides itself."""
    s = Swim(cfg, ME, honest_claim(0).member(), random.Random(1), now)
    for k in (1, 2, 3):
        out = s.handle(HONEST[k].peer_id, PushPull((honest_claim(k),), reply=False), now, origin="10.0.0.%d" % (k + 1))
        answer_verifications(s, out, now)
    assert s.live_count() == 4
    s.drain_changes()
    return s


def attack_pages(n_identities=72, per_page=64, seed=2, host=FAKE_ADDRESS[0], port=FAKE_ADDRESS[1]):
    """Each attacking identity's push-pull page: its own claim, then claims of fresh fakes."""
    pages = []
    for k, attacker in enumerate(identities(n_identities, seed)):
        fakes = identities(per_page, seed=1000 * seed + k)
        claims = [Claim.create(attacker, 0, ALIVE, host, port, "")]
        claims += [Claim.create(f, 0, ALIVE, host, port, "") for f in fakes]
        pages.append((attacker.peer_id, PushPull(tuple(claims), reply=False)))
    return pages


@pytest.fixture(scope="module")
def pages():
    return attack_pages()  # 72 x 65 signatures, made once


def flood(s, pages, now, origin_of, verify_sends=None):
    for k, (src, page) in enumerate(pages):
        out = s.handle(src, page, now, origin=origin_of(k))
        if verify_sends is not None:
            verify_sends += [x for x in out if x.dial]


def test_admissions_are_bounded_by_the_address_not_the_identities(pages):
    s = victim()
    flood(s, pages, 1.0, lambda k: ATTACKER_HOST)
    burst = CFG.new_member_burst_per_address
    assert len(s.members) == 4 + burst  # 72 x 65 claims pushed, one address's burst taken
    assert s.refused["address over its rate of new members"] == 72 * 65 - burst
    # the bucket refills at new_members_per_address_per_s, and a fresh identity's claim of
    # itself spends it like any other: ten seconds later, ten more
    flood(s, pages, 11.0, lambda k: ATTACKER_HOST)
    assert len(s.members) == 4 + burst + int(10 * CFG.new_members_per_address_per_s)
    # other addresses of the same IPv6 /64 are the same party; the next /64 is not
    s6 = victim()
    flood(s6, pages, 1.0, lambda k: "2001:db8:1:2::%x" % (k + 1))
    assert len(s6.members) == 4 + burst
    s6.handle(HONEST[1].peer_id, PushPull(pages[5][1].updates, reply=False), 1.0, origin="2001:db8:1:3::1")
    assert len(s6.members) == 4 + 2 * burst  # (relayed by HONEST[1]: its own allowance, 64, too)
    # an IPv4 address seen through an IPv4-mapped IPv6 socket is the same address
    s4 = victim()
    flood(s4, pages, 1.0, lambda k: ATTACKER_HOST if k % 2 else "::ffff:" + ATTACKER_HOST)
    assert len(s4.members) == 4 + burst


def test_fakes_never_answer_so_never_count_alive(pages):
    cfg = CFG.with_(push_pull_interval_s=0.0)
    s = victim(cfg)
    honest_hosts = {honest_claim(k).host for k in (1, 2, 3)}
    pings = []
    flood(s, pages, 1.0, lambda k: ATTACKER_HOST, pings)
    fakes = set(s.members) - {ME.peer_id, *HONEST_IDS}
    assert len(fakes) == CFG.new_member_burst_per_address
    # verification pings go out a few at a time, each to be sent over a connection dialled
    # to the claimed address, where nobody holding the key listens
    assert len(pings) == cfg.max_verifying and all(x.address == FAKE_ADDRESS for x in pings)
    # the attacker holds every fake's key and may connect as it, but cannot know the nonces:
    # acks of guessed seqs, or of a real nonce from another identity, confirm nobody
    attacker = pages[-1][0]  # one of the 72, not admitted itself
    for x in pings:
        s.handle(x.to, Ack(1), 1.1)
        s.handle(x.to, Ack(x.msg.seq + 1), 1.1)
        s.handle(attacker, Ack(x.msg.seq), 1.1)
    for seq in range(1, 200):
        s.handle(pings[0].to, Ack(seq), 1.2)
    assert not any(s.is_confirmed(p) for p in fakes)
    # five minutes of virtual time; the honest members answer every ping, the fakes none
    t, seen = 1.0, set()
    while t < 301.0:
        t = s.next_deadline()
        out = s.tick(t)
        answer_verifications(s, out, t, only=set(HONEST_IDS))
        for x in out:  # the honest members ack our probes, and nack probes of fakes for us
            if x.to in HONEST_IDS and isinstance(x.msg, Ping):
                s.handle(x.to, Ack(x.msg.seq), t)
            elif x.to in HONEST_IDS and isinstance(x.msg, PingReq):
                s.handle(x.to, Nack(x.msg.seq), t)
        live = {m.peer_id for m in s.live_members()}
        assert live == {ME.peer_id, *HONEST_IDS}, "a fake counted as alive"
        seen |= {m.peer_id for m in s.drain_changes()}
    assert not seen & fakes  # observers (the control plane) never heard of a fake
    assert {m.host for m in s.live_members()} <= honest_hosts | {"10.0.0.1"}
    # the fakes are found dead (they answer no probe) and removed
    assert not fakes & set(s.members)


def test_a_full_table_still_takes_an_honest_joiner(pages):
    cfg = CFG.with_(push_pull_interval_s=0.0)
    s = victim(cfg)
    # 72 identities, each from its own IPv6 /64: 4,680 claims, enough to fill 4,096 places
    flood(s, pages, 1.0, lambda k: "2001:db8:%x::1" % k)
    # (each page: its sender's own claim and 63 fakes fit its /64's burst of 64, the last not)
    assert len(s.members) == cfg.max_members and s.refused["address over its rate of new members"] == 72
    assert s.refused["member table full"] == 0 and s.evicted == 72 * 64 + 4 - cfg.max_members
    assert all(p in s.members for p in HONEST_IDS)  # confirmed members were never taken out
    assert s.live_count() == 4
    # an honest joiner from its own address: it takes the place of the longest-held fake,
    # answers its verification ping and counts as alive
    joiner = identities(1, seed=77)[0]
    claim = Claim.create(joiner, 0, ALIVE, "198.51.100.20", 7000, "us")
    out = s.handle(joiner.peer_id, PushPull((claim,), reply=True), 2.0, origin="198.51.100.20")
    assert joiner.peer_id in s.members and len(s.members) == cfg.max_members
    # verification pings are served a member per address group in turn: thousands of fakes
    # from 72 groups hold it up for a few rounds of max_verifying, not thousands
    t = 2.0
    while not s.is_confirmed(joiner.peer_id):
        answer_verifications(s, out, t, only={joiner.peer_id})
        t = s.next_deadline()
        out = s.tick(t)
    rounds = -(-73 // cfg.max_verifying)
    assert t - 2.0 <= rounds * cfg.verify_timeout_s
    assert s.live_count() == 5
    assert [m.peer_id for m in s.drain_changes()] == [joiner.peer_id]
    # the flood goes on from fresh /64s: it takes the places of fakes, never the joiner's
    more = attack_pages(8, seed=3)
    flood(s, more, 3.0, lambda k: "2001:db8:ff%02x::1" % k)
    assert joiner.peer_id in s.members and all(p in s.members for p in HONEST_IDS)
    assert len(s.members) == cfg.max_members


def test_a_full_table_keeps_the_members_the_allocation_names(pages):
    cfg = CFG.with_(max_members=64)
    s = victim(cfg)
    flood(s, pages[:1], 1.0, lambda k: "2001:db8:1::1")  # 60 fakes fill it
    named = {p for p in s.members if not s.is_confirmed(p)}
    assert len(named) == 60
    s.protected = named.__contains__  # say the allocation names them all (not yet verified)
    flood(s, pages[1:3], 2.0, lambda k: "2001:db8:%x::1" % (k + 2))
    assert {p for p in s.members if not s.is_confirmed(p)} == named
    assert s.refused["member table full"] == 2 * 65


# ---- status size


def big_member(identity, k, state, *, wide=True):
    host = ("\U0001F600" * MAX_HOST_LEN) if wide else "10.%d.%d.%d" % (k >> 16, (k >> 8) & 255, k & 255)
    region = "\U0001F600" * MAX_REGION_LEN if wide else "eu"
    return Member(identity.peer_id if identity else k.to_bytes(32, "big"), 2**63 - 1, state, host, 65535, region)


def test_the_status_of_a_flooded_table_fits_one_control_frame():
    # the worst case the table allows: max_members entries with the longest host and region a
    # claim may hold (4-byte characters), MAX_VIEW_PEERS of them confirmed and fully measured
    n_live = MAX_VIEW_PEERS
    members = [big_member(None, k, ALIVE) for k in range(CFG.max_members)]
    live = [m.peer_id for m in members[:n_live]]
    confirmed = set(live)
    reports = {p: Report(p, 1, 0.0, 1.0, tuple(Entry(q, 3.0 + k % 7, 1.0 + k % 5, 3) for k, q in enumerate(live) if q != p))
               for p in live}
    entries = [Entry(q, 3.0, 1.0, 3) for q in live[1:]]
    status = gossip_status(members, confirmed.__contains__, entries, live, reports,
                           lambda: build_view(tuple(live), reports))
    assert status["counts"] == {"alive": n_live, "suspect": 0, "unconfirmed": CFG.max_members - n_live,
                                "dead": 0, "left": 0, "total": CFG.max_members}
    assert len(status["members"]) == MAX_MEMBERS_LISTED
    assert status["truncated"] == ["members", "view.disputed"]  # (the figures disagree a lot)
    assert len(status["view"]["disputed"]) == MAX_DISPUTED_LISTED
    assert status["members"][0]["state"] == "alive"  # the ones that count come first
    assert status["view"]["measured_links"] == status["view"]["expected_links"] == n_live * (n_live - 1)
    size = len(pack(status))
    assert size < 2 * 1024 * 1024, size
    # one more live peer than listed: the matrices are left out, the counts stay
    live2 = live + [members[n_live].peer_id]
    status2 = gossip_status(members, set(live2).__contains__, entries, live2, reports, pytest.fail)
    assert "delay_ms" not in status2["view"] and "view" in status2["truncated"]
    assert status2["view"]["peer_count"] == n_live + 1
    assert status2["view"]["measured_links"] == n_live * (n_live - 1)
    assert not status2["view"]["complete"]
    # the daemon's whole report around it goes out in one frame
    report = {"peer_id": "ab" * 32, "short_id": "abababab", "peers": [], "departed": [], "gossip": status}
    reply = {"ok": True, "result": fit_report(report, FRAME_BYTES - REPLY_OVERHEAD_BYTES)}
    assert len(encode_frame(reply, FRAME_BYTES)) <= FRAME_BYTES + 4


def test_an_oversized_report_is_cut_to_fit_and_says_so():
    row = {"peer_id": "cd" * 32, "short_id": "cdcdcdcd", "address": "127.0.0.1:1", "region": "",
           "last_seen_s_ago": 0.1, "connected_for_s": 1.0}
    report = {"peer_id": "ab" * 32, "short_id": "abababab", "listen": "127.0.0.1:7000", "uptime_s": 1.0,
              "peers": [dict(row) for _ in range(5000)], "departed": [],
              "gossip": {"members": ["x" * 100] * 20000}, "training": {"state": "idle"}}
    assert fit_report(report, 1 << 30) is report  # what fits is left alone
    for limit in (64 * 1024, 8 * 1024):
        out = fit_report(report, limit)
        assert len(pack(out)) <= limit
        assert out["truncated"][0] == "gossip" and out["gossip"]["truncated"] is True
        assert out["training"] == {"state": "idle"}  # small sections stay
        if "peers" in out["truncated"]:
            assert 0 < len(out["peers"]) < 5000 and out["peers"][0] == row  # a prefix, still rows
    text = format_text(fit_report(report, 8 * 1024))
    assert "truncated gossip, peers (too big for one reply" in text
