import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.gossip.broadcast import BroadcastQueue
from dtfm.gossip.config import GossipConfig
from dtfm.gossip.members import Member, MemberState, Update, merge_entry, merge_tables
from dtfm.gossip.messages import Ack, Gossip, MsgType, Nack, Ping, PingReq, PushPull, decode_swim
from dtfm.gossip.suspicion import Suspicion, remaining_suspicion_time
from dtfm.net.errors import ProtocolError
from dtfm.net.wire import pack, unpack_untrusted

ids = st.sampled_from([bytes([i]) * 32 for i in range(4)])
members = st.builds(Member, ids, st.integers(0, 5), st.sampled_from(list(MemberState)),
                    st.sampled_from(["10.0.0.1", "10.0.0.2"]), st.integers(0, 65535),
                    st.sampled_from(["", "Oregon"]))
updates = st.builds(Update, members, ids)
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
    for msg in [Ping(seq, target.peer_id, ups), Ack(seq, ups), PingReq(seq, target, ups), Nack(seq),
                Gossip(ups), PushPull(tuple(u.member for u in ups), True)]:
        assert roundtrip(msg) == msg


@settings(max_examples=150)
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
    for bad in [{**good, "seq": -1}, {**good, "seq": True}, {**good, "target": b"x" * 31},
                {**good, "u": [[b"\x01" * 32, 0, 9, "h", 1, "", b"\x01" * 32]]},
                {**good, "u": [[b"\x01" * 32, 0, 0, "h", 70000, "", b"\x01" * 32]]},
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
    m = Member(b"\x01" * 32, 0, MemberState.ALIVE, "h", 1, "")
    q.queue(Update(m, m.peer_id))
    q.queue(Update(m.with_state(MemberState.SUSPECT), m.peer_id))
    assert len(q) == 1
    assert q.take(10_000, 2)[0].member.state == MemberState.SUSPECT
    assert len(q.take(10_000, 2)) == 1
    assert q.take(10_000, 2) == []
    q.queue(Update(m, m.peer_id))
    assert q.take(10, 2) == []  # does not fit


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
