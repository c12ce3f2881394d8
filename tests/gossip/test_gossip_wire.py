import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.gossip.broadcast import BroadcastQueue
from dtfm.gossip.claims import Accusation, Claim, ClaimVerifier
from dtfm.gossip.config import GossipConfig
from dtfm.gossip.members import MAX_INCARNATION, Member, MemberState, merge_entry, merge_tables
from dtfm.gossip.messages import Ack, Gossip, MsgType, Nack, Ping, PingReq, PushPull, decode_swim
from dtfm.gossip.suspicion import Suspicion, remaining_suspicion_time
from dtfm.net import Identity
from dtfm.net.errors import ProtocolError
from dtfm.net.wire import pack, unpack_untrusted

KEYS = [Identity(bytes([i + 1]) * 32) for i in range(4)]
ids = st.sampled_from([k.peer_id for k in KEYS])
members = st.builds(Member, ids, st.integers(0, 5), st.sampled_from(list(MemberState)),
                    st.sampled_from(["10.0.0.1", "10.0.0.2"]), st.integers(0, 65535),
                    st.sampled_from(["", "Oregon"]))
claims = st.builds(lambda k, inc, left, host, port, region: Claim.create(
    KEYS[k], inc, MemberState.LEFT if left else MemberState.ALIVE, host, port, region),
    st.integers(0, 3), st.integers(0, MAX_INCARNATION), st.booleans(), st.sampled_from(["10.0.0.1", "h" * 255]),
    st.integers(0, 65535), st.sampled_from(["", "Oregon", "r" * 64]))
accusations = st.builds(lambda by, of, inc, dead: Accusation.create(
    KEYS[by], KEYS[(by + of) % 4].peer_id, inc, MemberState.DEAD if dead else MemberState.SUSPECT),
    st.integers(0, 3), st.integers(1, 3), st.integers(0, MAX_INCARNATION), st.booleans())
updates = claims | accusations
tables = st.lists(members, max_size=6).map(lambda ms: _table(ms))


def _table(ms):
    out = {}
    for m in ms:
        out[m.peer_id] = merge_entry(out.get(m.peer_id), m)
    return out


def roundtrip(msg):
    data = pack(msg.to_wire())
    return decode_swim(msg.type, unpack_untrusted(data, max_len=1 << 20))


@given(tables, tables, tables)
def test_merge_is_commutative_associative_idempotent(a, b, c):
    assert merge_tables(a, b) == merge_tables(b, a)
    assert merge_tables(merge_tables(a, b), c) == merge_tables(a, merge_tables(b, c))
    assert merge_tables(a, a) == a


@given(tables, tables)
def test_merge_is_monotone(a, b):
    m = merge_tables(a, b)
    for pid, entry in a.items():
        assert m[pid].key() >= entry.key()


def test_swim_precedence_at_one_incarnation():
    pid = b"\x01" * 32
    alive = Member(pid, 3, MemberState.ALIVE, "h", 1, "")
    assert merge_entry(alive, alive.with_state(MemberState.SUSPECT)).state == MemberState.SUSPECT
    assert merge_entry(alive.with_state(MemberState.DEAD), alive.with_state(MemberState.SUSPECT)).state == MemberState.DEAD
    refuted = alive.with_state(MemberState.ALIVE, 4)
    assert merge_entry(alive.with_state(MemberState.DEAD), refuted) == refuted


@given(st.lists(updates, max_size=5), st.integers(0, 2**63 - 1), members)
def test_messages_roundtrip(ups, seq, target):
    ups = tuple(ups)
    for msg in [Ping(seq, target.peer_id, ups), Ack(seq, ups), PingReq(seq, target.peer_id, ups), Nack(seq),
                Gossip(ups), PushPull(ups, True)]:
        assert roundtrip(msg) == msg
        assert all(u.verify() for u in roundtrip(msg).updates) if hasattr(msg, "updates") else True


@given(updates)
def test_wire_size_bounds_the_packed_update(u):
    assert len(pack(u.to_wire())) <= u.wire_size


def test_signatures_cover_every_field_and_the_verifier_caches_valid_ones():
    c = Claim.create(KEYS[0], 3, MemberState.ALIVE, "10.0.0.1", 7000, "r")
    a = Accusation.create(KEYS[1], KEYS[0].peer_id, 3, MemberState.SUSPECT)
    assert c.verify() and a.verify()
    for field, value in [("incarnation", 4), ("state", MemberState.LEFT), ("host", "10.0.0.2"),
                         ("port", 7001), ("region", "s"), ("signature", bytes(64))]:
        assert not dataclasses.replace(c, **{field: value}).verify(), field
    for field, value in [("accuser", KEYS[2].peer_id), ("incarnation", 2), ("state", MemberState.DEAD)]:
        assert not dataclasses.replace(a, **{field: value}).verify(), field
    v = ClaimVerifier(max_entries=2)
    assert v.verify(c) and v.verify(c) and v.checks == 1  # the second one is a cache hit
    assert not v.verify(dataclasses.replace(c, port=7001)) and v.checks == 2  # same key, other fields
    assert v.verify(a) and v.checks == 3
    assert v.verify(Claim.create(KEYS[2], 0, MemberState.ALIVE, "h", 1, "")) and v.checks == 4
    assert v.verify(c) and v.checks == 5  # evicted (two entries at most): checked again


@settings(max_examples=300)
@given(st.sampled_from(list(MsgType)[:6]), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5) | st.binary(max_size=40),
    lambda c: st.lists(c, max_size=7) | st.dictionaries(st.sampled_from(["seq", "u", "target", "m", "reply"]), c, max_size=5),
    max_leaves=20))
def test_garbage_raises_only_protocol_error(msg_type, body):
    try:
        decode_swim(msg_type, body)
    except ProtocolError:
        pass


def test_field_checks():
    good = Ping(1, b"\x01" * 32, ()).to_wire()
    c = Claim.create(KEYS[0], 0, MemberState.ALIVE, "h", 1, "").to_wire()
    a = Accusation.create(KEYS[1], KEYS[0].peer_id, 0, MemberState.SUSPECT).to_wire()
    assert decode_swim(MsgType.PING, {**good, "u": [c, a]}).updates[1].accuser == KEYS[1].peer_id
    for bad in [{**good, "seq": -1}, {**good, "seq": True}, {**good, "target": b"x" * 31},
                {**good, "u": [c[:3] + [9] + c[4:]]},  # no such state
                {**good, "u": [c[:3] + [1] + c[4:]]},  # a claim says alive or left only
                {**good, "u": [a[:4] + [0] + a[5:]]},  # an accusation says suspect or dead only
                {**good, "u": [c[:5] + [70000] + c[6:]]},
                {**good, "u": [c[:2] + [2**63] + c[3:]]},  # incarnation past the largest
                {**good, "u": [c[:7] + [b"s" * 63]]},  # short signature
                {**good, "u": [a[:2] + [a[1]] + a[3:]]},  # accuses itself
                {**good, "u": [[2] + c[1:]]}, {**good, "u": [[]]}, {**good, "u": [c + [1]]},
                {**good, "u": [c] * 65},  # more than a message carries
                {k: v for k, v in good.items() if k != "seq"}, [1, 2]]:
        with pytest.raises(ProtocolError):
            decode_swim(MsgType.PING, bad)
    with pytest.raises(ProtocolError):
        decode_swim(99, good)


def test_remaining_suspicion_time_table():
    # memberlist's suspicion_test.go: n confirmations of k=3, min 2 s, max 30 s
    cases = [(0, 3, 0.0, 30.0), (1, 3, 2.0, 14.0), (2, 3, 3.0, 4.810), (3, 3, 4.0, -2.0),
             (4, 3, 5.0, -3.0), (5, 3, 10.0, -8.0)]
    for n, k, elapsed, want in cases:
        assert remaining_suspicion_time(n, k, elapsed, 2.0, 30.0) == pytest.approx(want, abs=1e-3)
    assert remaining_suspicion_time(5, 0, 1.0, 2.0, 30.0) == 1.0


def test_suspicion_counts_distinct_confirmations_only():
    a, b, c = (bytes([i]) * 32 for i in range(3))
    s = Suspicion(a, k=2, min_s=2.0, max_s=12.0, now=100.0)
    assert s.deadline == 112.0
    assert not s.confirm(a, 101.0)
    assert s.confirm(b, 101.0)
    assert s.deadline == pytest.approx(100.0 + 12.0 - math.log(2) / math.log(3) * 10.0, abs=1e-3)
    assert not s.confirm(b, 101.0)
    assert s.confirm(c, 101.0) and s.deadline == 102.0
    assert not s.confirm(bytes([9]) * 32, 101.0)  # k reached


def test_broadcast_queue_limits_and_replacement():
    q = BroadcastQueue()
    pid = KEYS[0].peer_id
    q.queue(Claim.create(KEYS[0], 0, MemberState.ALIVE, "h", 1, ""))
    q.queue(Claim.create(KEYS[0], 1, MemberState.ALIVE, "h", 1, ""))
    assert len(q) == 1  # the newer claim replaced the older one
    q.queue(Accusation.create(KEYS[1], pid, 1, MemberState.SUSPECT))
    q.queue(Accusation.create(KEYS[2], pid, 1, MemberState.SUSPECT))
    assert len(q) == 2  # ... and the newer accusation the older one, beside the claim
    taken = q.take(10_000, 2)
    assert [type(u) for u in taken] == [Accusation, Claim] and taken[0].accuser == KEYS[2].peer_id
    assert len(q.take(10_000, 2)) == 2
    assert q.take(10_000, 2) == []
    q.queue(Claim.create(KEYS[0], 0, MemberState.ALIVE, "h", 1, ""))
    assert q.take(100, 2) == []  # does not fit


def test_config_profiles_and_validation():
    for cfg in [GossipConfig.lan(), GossipConfig.wan(), GossipConfig.local(), GossipConfig.test()]:
        assert cfg.probe_timeout_s <= cfg.probe_interval_s
    lan = GossipConfig.lan()
    assert lan.suspicion_min_s(16) == pytest.approx(4 * math.log10(16))
    assert lan.suspicion_min_s(5) == 4.0
    assert lan.suspicion_max_s(16) == pytest.approx(6 * 4 * math.log10(16))
    assert lan.retransmit_limit(16) == 8
    assert lan.push_pull_scaled_s(64) == 60.0
    with pytest.raises(ValueError):
        GossipConfig(probe_timeout_s=2.0)
    with pytest.raises(ValueError):
        GossipConfig(indirect_checks=-1)
    with pytest.raises(ValueError):
        GossipConfig(probe_interval_s=float("nan"))
    with pytest.raises(ValueError):
        GossipConfig(record_sync_timeout_s=0.0)
