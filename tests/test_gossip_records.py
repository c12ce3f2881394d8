import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.gossip.records import MAX_GBPS, Entry, RecordStore, RecordSync, Report
from dtfm.gossip.view import build_view
from dtfm.net.errors import ProtocolError
from dtfm.net.identity import Identity
from dtfm.net.wire import pack, unpack_untrusted

NOW = 1.8e9
ALICE = Identity(b"\x01" * 32)
BOB = Identity(b"\x02" * 32)
CAROL = Identity(b"\x03" * 32)
MEMBERS = {ALICE.peer_id, BOB.peer_id, CAROL.peer_id}


def is_member(p):
    return p in MEMBERS


def report(ident=ALICE, seq=1, ts=NOW, rtt=10.0, bw=1.0):
    targets = [i.peer_id for i in (ALICE, BOB, CAROL) if i is not ident]
    return Report.create(ident, seq, ts, 5.0, [Entry(t, rtt, bw, 5) for t in targets])


def wire(r):
    return Report.from_wire(unpack_untrusted(pack(r.to_wire()), max_len=1 << 20))


def test_report_roundtrip_and_signature():
    r = report()
    assert wire(r) == r and r.verify()
    assert [e.target for e in r.entries] == sorted(e.target for e in r.entries)


def test_acceptance_rules():
    store = RecordStore(skew_s=600)
    assert store.offer(report(seq=5), now_wall=NOW, is_member=is_member) is None
    assert "not newer" in store.offer(report(seq=5), now_wall=NOW, is_member=is_member)  # replay
    assert "not newer" in store.offer(report(seq=4), now_wall=NOW, is_member=is_member)  # stale
    assert store.offer(report(seq=6), now_wall=NOW, is_member=is_member) is None
    assert "skew" in store.offer(report(seq=7, ts=NOW - 601), now_wall=NOW, is_member=is_member)
    assert "skew" in store.offer(report(seq=7, ts=NOW + 601), now_wall=NOW, is_member=is_member)
    stranger = Identity(b"\x09" * 32)
    assert "not a live member" in store.offer(report(stranger), now_wall=NOW, is_member=is_member)
    assert store.reports[ALICE.peer_id].seq == 6


def test_forged_and_tampered_reports_refused():
    store = RecordStore(skew_s=600)
    genuine = report(seq=3)
    # Bob signs a report that claims to be Alice's
    forged = Report(ALICE.peer_id, 9, NOW, 5.0, genuine.entries,
                    BOB.sign(Report(ALICE.peer_id, 9, NOW, 5.0, genuine.entries).signing_bytes()))
    assert store.offer(forged, now_wall=NOW, is_member=is_member) == "bad signature"
    # a genuine report with one figure changed in transit
    e = genuine.entries[0]
    tampered = Report(ALICE.peer_id, 3, NOW, 5.0, (Entry(e.target, 1.0, e.bandwidth_gbps, 5),)
                      + genuine.entries[1:], genuine.signature)
    assert store.offer(tampered, now_wall=NOW, is_member=is_member) == "bad signature"
    # higher sequence number pasted onto an old signature
    bumped = Report(ALICE.peer_id, 4, NOW, 5.0, genuine.entries, genuine.signature)
    assert store.offer(bumped, now_wall=NOW, is_member=is_member) == "bad signature"
    assert store.reports == {}


def test_retired_measurer_refused_until_newer_report():
    store = RecordStore(skew_s=600)
    old = report(BOB, seq=10)
    assert store.offer(old, now_wall=NOW, is_member=is_member) is None
    store.retire(BOB.peer_id)
    assert BOB.peer_id not in store.reports
    assert "retired" in store.offer(old, now_wall=NOW, is_member=is_member)  # replayed after death
    assert store.offer(report(BOB, seq=11), now_wall=NOW, is_member=is_member) is None  # came back


@pytest.mark.parametrize("fields", [
    [b"\x02" * 32, -1.0, 1.0, 5], [b"\x02" * 32, float("nan"), 1.0, 5], [b"\x02" * 32, 0.0, 1.0, 5],
    [b"\x02" * 32, 10.0, MAX_GBPS * 2, 5], [b"\x02" * 32, 10.0, -1.0, 5], [b"\x02" * 32, 10.0, 1.0, 0],
    [b"\x02" * 32, float("inf"), 1.0, 5], [b"\x02" * 31, 10.0, 1.0, 5], [b"\x02" * 32, 10.0, 1.0],
])
def test_impossible_values_refused(fields):
    r = report()
    w = r.to_wire()
    w[4] = [fields]
    with pytest.raises(ProtocolError):
        Report.from_wire(w)


def test_unsorted_duplicate_or_self_entries_refused():
    r = report()
    w = r.to_wire()
    for entries in [w[4][::-1], [w[4][0], w[4][0]], [[ALICE.peer_id, 1.0, 1.0, 1]]]:
        bad = list(w)
        bad[4] = entries
        with pytest.raises(ProtocolError):
            Report.from_wire(bad)


@settings(max_examples=200)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.binary(max_size=70),
                    lambda c: st.lists(c, max_size=7) | st.dictionaries(
                        st.sampled_from(["phase", "hash", "digest", "reports"]), c, max_size=3), max_leaves=25))
def test_sync_garbage_raises_only_protocol_error(body):
    try:
        RecordSync.from_wire(body)
    except ProtocolError:
        pass


def test_sync_roundtrip_and_digest_exchange():
    a, b = RecordStore(600), RecordStore(600)
    for ident, store in [(ALICE, a), (BOB, b)]:
        store.offer(report(ident), now_wall=NOW, is_member=is_member)
    b.offer(report(CAROL, seq=2), now_wall=NOW, is_member=is_member)
    a.offer(report(CAROL, seq=1), now_wall=NOW, is_member=is_member)
    assert a.digest_hash() != b.digest_hash()
    msg = RecordSync(2, b"", b.digest(), b.newer_than(a.digest(), 1 << 20))
    msg = RecordSync.from_wire(unpack_untrusted(pack(msg.to_wire()), max_len=1 << 20))
    assert {r.measurer for r in msg.reports} == {BOB.peer_id, CAROL.peer_id}
    for r in msg.reports:
        assert a.offer(r, now_wall=NOW, is_member=is_member) is None
    assert [r.measurer for r in a.newer_than(msg.digest, 1 << 20)] == [ALICE.peer_id]
    assert a.newer_than(msg.digest, 1) != ()  # always at least one per message
    for r in a.newer_than(msg.digest, 1 << 20):
        b.offer(r, now_wall=NOW, is_member=is_member)
    assert a.digest_hash() == b.digest_hash()


def _reports_from_matrix(ids, rtt, bw):
    out = {}
    for i, ident in enumerate(ids):
        entries = [Entry(ids[j].peer_id, rtt[i, j], bw[i, j], 5) for j in range(len(ids)) if j != i]
        out[ident.peer_id] = Report.create(ident, 1, NOW, 1.0, entries)
    return out


def test_view_combines_both_ends_and_flags_completeness():
    ids = [Identity(bytes([i + 1]) * 32) for i in range(3)]
    rtt = np.array([[0, 10, 20], [12, 0, 30], [20, 30, 0]], float)
    bw = np.array([[0, 1, 2], [1, 0, 4], [2, 4, 0]], float)
    view = build_view([i.peer_id for i in ids], _reports_from_matrix(ids, rtt, bw))
    assert view.complete
    assert view.delay_ms[0, 1] == view.delay_ms[1, 0] == pytest.approx(math.sqrt(120) / 2)
    assert view.delay_ms[0, 2] == 10.0 and view.bandwidth_gbps[1, 2] == 4.0
    assert np.all(np.diag(view.delay_ms) == 0) and np.all(np.isinf(np.diag(view.bandwidth_gbps)))
    partial = build_view([i.peer_id for i in ids] + [b"\x09" * 32], _reports_from_matrix(ids, rtt, bw))
    assert not partial.complete and partial.pairs_known() == 6
    slow = view.unscaled(time_scale=2.0, bandwidth_scale=4.0)
    assert slow.delay_ms[0, 2] == 5.0 and slow.bandwidth_gbps[1, 2] == 2.0


@settings(max_examples=30, deadline=None)
@given(st.integers(4, 9), st.sampled_from([0.1, 0.4, 3.0, 20.0]), st.integers(0, 2**32 - 1))
def test_a_liar_cannot_move_estimates_outside_honest_measurements(n, factor, seed):
    rng = np.random.default_rng(seed)
    true_rtt = rng.uniform(1, 200, (n, n))
    true_rtt = (true_rtt + true_rtt.T) / 2
    true_bw = rng.uniform(0.05, 10, (n, n))
    true_bw = (true_bw + true_bw.T) / 2
    noise = lambda: rng.uniform(0.9, 1.1, (n, n))  # honest measurements within 10%
    rtt, bw = true_rtt * noise(), true_bw * noise()
    liar = int(rng.integers(n))
    rtt[liar] *= factor  # the liar scales every figure it reports about its own links
    bw[liar] /= factor
    ids = [Identity(bytes([i + 1]) * 32) for i in range(n)]
    view = build_view([i.peer_id for i in ids], _reports_from_matrix(ids, rtt, bw))
    for j in range(n):
        if j == liar:
            continue
        honest_rtt, honest_bw = rtt[j, liar], bw[j, liar]  # the only honest figure of this link
        assert view.delay_ms[liar, j] * 2 == pytest.approx(honest_rtt)
        assert view.bandwidth_gbps[liar, j] == pytest.approx(honest_bw)
        for k in range(n):
            if k not in (j, liar):  # honest pairs stay between their two measurements
                lo, hi = sorted([rtt[j, k], rtt[k, j]])
                assert lo - 1e-9 <= view.delay_ms[j, k] * 2 <= hi + 1e-9
