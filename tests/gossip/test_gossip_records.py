import math
from dataclasses import replace

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.gossip.records import CODEC_NS_LEN, DOMAIN, MAX_CODEC_NS, MAX_ENTRIES, MAX_GBPS, Entry, RecordStore, Report
from dtfm.gossip.service import offer_all
from dtfm.gossip.sync import (
    RecordSync,
    RecordSyncer,
    SyncActions,
    SyncLimits,
    SyncPhase,
    SyncRole,
    SyncStep,
    VerifyBudget,
)
from dtfm.gossip.view import build_view
from dtfm.net import ProtocolError
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


CODEC = (2.9, 1.0, 6.6, 2.3, 6.6, 20.7, 5.6)  # a coding-speed vector, ns per element


def test_a_report_carries_its_coding_speed_under_its_signature():
    targets = [BOB.peer_id, CAROL.peer_id]
    r = Report.create(ALICE, 1, NOW, 5.0, [Entry(t, 10.0, 1.0, 5) for t in targets], codec_ns=CODEC)
    assert r.codec_ns == CODEC and wire(r) == r and wire(r).verify()
    assert len(pack(r.to_wire())) <= r.wire_size
    changed = Report(r.measurer, r.seq, r.timestamp, r.compute_ms, r.entries, r.signature, (0.0,) * CODEC_NS_LEN)
    assert not wire(changed).verify()  # another vector under the same signature
    dropped = Report(r.measurer, r.seq, r.timestamp, r.compute_ms, r.entries, r.signature)
    assert not wire(dropped).verify()  # the vector left out
    assert report().codec_ns == () and wire(report()).verify()  # none measured: an empty vector
    with pytest.raises(ValueError):
        Report.create(ALICE, 1, NOW, 5.0, [], codec_ns=CODEC[:3])


HOST = bytes(range(1, 9))  # a machine's fingerprint (HOST_ID_LEN bytes)


def test_a_report_carries_its_machine_under_its_signature_and_older_reports_decode():
    """The host is an eleventh wire field, signed; a report without one is the ten fields an
    older peer sends and signs, and still decodes and verifies."""
    targets = [BOB.peer_id, CAROL.peer_id]
    r = Report.create(ALICE, 1, NOW, 5.0, [Entry(t, 10.0, 1.0, 5) for t in targets], host=HOST)
    assert r.host == HOST and wire(r) == r and wire(r).verify()
    assert len(r.to_wire()) == 11 and len(pack(r.to_wire())) <= r.wire_size
    other = Report(r.measurer, r.seq, r.timestamp, r.compute_ms, r.entries, r.signature, host=bytes(8))
    assert not wire(other).verify()  # another machine under the same signature
    dropped = r.to_wire()[:10]
    assert not Report.from_wire(dropped).verify()  # the host cut off: the signature no longer holds
    old = report()  # no host: the ten fields, signed as an older peer signs them
    assert old.host == b"" and len(old.to_wire()) == 10 and wire(old).verify()
    assert old.signing_bytes() == DOMAIN + pack(old.to_wire()[:5] + old.to_wire()[6:])
    view = build_view([ALICE.peer_id, BOB.peer_id], [r, report(BOB)])
    assert view.hosts == (HOST, b"")  # a peer without a host: unknown


def test_a_report_carries_its_computes_share_of_a_core_under_its_signature():
    """The compute's share of a core is a twelfth wire field (the host before it, empty where
    unknown), signed; unknown (0) leaves the report as it was; the view holds it per peer."""
    r = Report.create(ALICE, 1, NOW, 70.0, [Entry(BOB.peer_id, 10.0, 1.0, 5)], host=HOST, compute_share=0.5)
    assert r.compute_share == 0.5 and wire(r) == r and wire(r).verify()
    assert len(r.to_wire()) == 12 and len(pack(r.to_wire())) <= r.wire_size
    no_host = Report.create(ALICE, 1, NOW, 70.0, [], compute_share=0.5)
    assert no_host.to_wire()[10] == b"" and wire(no_host) == no_host and wire(no_host).verify()
    assert len(Report.create(ALICE, 1, NOW, 70.0, [], host=HOST).to_wire()) == 11  # unknown: as before
    other = replace(r, compute_share=1.0)
    assert not wire(other).verify()  # another share under the same signature
    assert not Report.from_wire(r.to_wire()[:11]).verify()  # the share cut off
    view = build_view([ALICE.peer_id, BOB.peer_id], [r, report(BOB)])
    assert view.compute_share[0] == 0.5 and math.isnan(view.compute_share[1])
    for bad in (0.0, -0.5, 1.5, float("nan"), float("inf"), "half", None, True, [0.5]):
        w = r.to_wire()
        w[11] = bad
        with pytest.raises(ProtocolError):
            Report.from_wire(w)
    for bad in (-0.5, 1.5, float("nan")):
        with pytest.raises(ValueError):
            Report.create(ALICE, 1, NOW, 70.0, [], compute_share=bad)


@pytest.mark.parametrize("host", [b"", b"\x01" * 7, b"\x01" * 9, "machine", 8, None, [1] * 8, True])
def test_hostile_hosts_refused(host):
    w = Report.create(ALICE, 1, NOW, 5.0, [], host=HOST).to_wire()
    w[10] = host
    with pytest.raises(ProtocolError):
        Report.from_wire(w)
    with pytest.raises(ProtocolError):
        Report.from_wire(w + [HOST])  # a twelfth field
    if isinstance(host, bytes) and host:
        with pytest.raises(ValueError):
            Report.create(ALICE, 1, NOW, 5.0, [], host=host)


@pytest.mark.parametrize("codec", [
    CODEC[:-1], CODEC + (1.0,), [1.0], "fast", None, 7, {"int8": 1.0}, list(CODEC[:-1]) + ["1"],
    list(CODEC[:-1]) + [True], list(CODEC[:-1]) + [None], list(CODEC[:-1]) + [float("nan")],
    list(CODEC[:-1]) + [float("inf")], list(CODEC[:-1]) + [-0.5], list(CODEC[:-1]) + [MAX_CODEC_NS * 2],
    list(CODEC[:-1]) + [[1.0]], [CODEC] * 7,
])
def test_hostile_coding_speed_vectors_refused(codec):
    w = report().to_wire()
    w[6] = codec
    with pytest.raises(ProtocolError):
        Report.from_wire(w)
    with pytest.raises(ProtocolError):
        Report.from_wire(report().to_wire()[:6])  # the field left out


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
    msg = RecordSync(SyncStep.OFFER, b"", b.digest(), b.newer_than(a.digest(), 1 << 20))
    msg = RecordSync.from_wire(unpack_untrusted(pack(msg.to_wire()), max_len=1 << 20))
    assert {r.measurer for r in msg.reports} == {BOB.peer_id, CAROL.peer_id}
    for r in msg.reports:
        assert a.offer(r, now_wall=NOW, is_member=is_member) is None
    assert [r.measurer for r in a.newer_than(msg.digest, 1 << 20)] == [ALICE.peer_id]
    assert a.newer_than(msg.digest, 1) != ()  # always at least one per message
    for r in a.newer_than(msg.digest, 1 << 20):
        b.offer(r, now_wall=NOW, is_member=is_member)
    assert a.digest_hash() == b.digest_hash()


# ---- the record-sync state machine, phase x input -> next phase + actions
#
# This side ("us") holds Alice's report and Carol's seq 1; the peer, Bob, holds his own and
# Carol's seq 2. So we offer Alice's, and Bob's reports to us are his and Carol's newer one.

TIMEOUT = 10.0
INIT, RESP = SyncRole.INITIATOR, SyncRole.RESPONDER
IDLE, HASH_SENT, OFFER_SENT, DIGEST_SENT = (SyncPhase.IDLE, SyncPhase.HASH_SENT, SyncPhase.OFFER_SENT,
                                            SyncPhase.DIGEST_SENT)
PEER = BOB.peer_id


def stores():
    ours, theirs = RecordStore(600), RecordStore(600)
    for store, reps in [(ours, [report(ALICE), report(CAROL, seq=1)]), (theirs, [report(BOB), report(CAROL, seq=2)])]:
        for r in reps:
            assert store.offer(r, now_wall=NOW, is_member=is_member) is None
    return ours, theirs


def peer_message(name):
    ours, theirs = stores()
    both = RecordStore(600)
    for r in [report(ALICE), report(BOB), report(CAROL, seq=2)]:
        both.offer(r, now_wall=NOW, is_member=is_member)
    lacking = theirs.newer_than(ours.digest(), 1 << 20)
    return {
        "HASH, differs": RecordSync(SyncStep.HASH, theirs.digest_hash(), (), ()),
        "HASH, equal": RecordSync(SyncStep.HASH, ours.digest_hash(), (), ()),
        "DIGEST": RecordSync(SyncStep.DIGEST, b"", theirs.digest(), ()),
        "OFFER": RecordSync(SyncStep.OFFER, b"", theirs.digest(), lacking),
        "OFFER, holds all we do": RecordSync(SyncStep.OFFER, b"", both.digest(), lacking),
        "REPORTS": RecordSync(SyncStep.REPORTS, b"", (), lacking),
    }[name]


def deliver(m, msg, now=0.0):
    """Through the wire codec, as the service receives it."""
    return m.handle(PEER, RecordSync.from_wire(unpack_untrusted(pack(msg.to_wire()), max_len=1 << 20)), now)


def syncer_in(role, phase, **kw):
    """A machine driven, by real transitions at t = 0, into `phase` for `role` with the peer."""
    m = RecordSyncer(stores()[0], max_sync_bytes=1 << 20, timeout_s=TIMEOUT, **kw)
    if phase in (HASH_SENT, OFFER_SENT):
        m.start(PEER, 0.0)
    if phase is OFFER_SENT:
        deliver(m, peer_message("DIGEST"))
    if phase is DIGEST_SENT:
        deliver(m, peer_message("HASH, differs"))
    assert m.phase(PEER, role) is phase
    return m


A_ID, B_ID, C_ID = ALICE.peer_id, BOB.peer_id, CAROL.peer_id


@pytest.mark.parametrize("role, phase, given, then, reply, reply_reports, accepted", [
    # initiator
    (INIT, IDLE, "DIGEST", IDLE, None, (), ()),  # unsolicited or late: dropped
    (INIT, IDLE, "REPORTS", IDLE, None, (), ()),
    (INIT, HASH_SENT, "DIGEST", OFFER_SENT, SyncStep.OFFER, (A_ID,), ()),
    (INIT, HASH_SENT, "REPORTS", HASH_SENT, None, (), (B_ID, C_ID)),  # late, from a replaced round
    (INIT, OFFER_SENT, "REPORTS", IDLE, None, (), (B_ID, C_ID)),
    (INIT, OFFER_SENT, "DIGEST", OFFER_SENT, None, (), ()),  # a duplicate digest
    # responder
    (RESP, IDLE, "HASH, differs", DIGEST_SENT, SyncStep.DIGEST, (), ()),
    (RESP, IDLE, "HASH, equal", IDLE, None, (), ()),  # steady state: one hash, nothing else
    (RESP, IDLE, "OFFER", IDLE, None, (), ()),  # unsolicited: its reports are not taken
    (RESP, DIGEST_SENT, "OFFER", IDLE, SyncStep.REPORTS, (A_ID,), (B_ID, C_ID)),
    (RESP, DIGEST_SENT, "OFFER, holds all we do", IDLE, None, (), (B_ID, C_ID)),
    (RESP, DIGEST_SENT, "HASH, differs", DIGEST_SENT, SyncStep.DIGEST, (), ()),  # a new round
    (RESP, DIGEST_SENT, "HASH, equal", IDLE, None, (), ()),
])
def test_sync_transitions(role, phase, given, then, reply, reply_reports, accepted):
    m = syncer_in(role, phase)
    other = INIT if role is RESP else RESP
    actions = deliver(m, peer_message(given))
    assert m.phase(PEER, role) is then
    assert m.phase(PEER, other) is IDLE  # the other role's session is untouched
    assert (actions.reply.step if actions.reply else None) is reply
    assert (tuple(r.measurer for r in actions.reply.reports) if actions.reply else ()) == reply_reports
    assert tuple(sorted(r.measurer for r in actions.accept)) == accepted
    if reply in (SyncStep.DIGEST, SyncStep.OFFER):
        assert actions.reply.digest == m.store.digest()


def test_sync_start_emits_our_hash_and_replaces_a_round_in_progress():
    m = syncer_in(INIT, OFFER_SENT)
    msg = m.start(PEER, 5.0)
    assert msg == RecordSync(SyncStep.HASH, m.store.digest_hash(), (), ())
    assert m.phase(PEER, INIT) is HASH_SENT
    # the replaced round's reports are still taken; the new round goes on
    assert len(deliver(m, peer_message("REPORTS"), 6.0).accept) == 2
    assert m.phase(PEER, INIT) is HASH_SENT
    assert deliver(m, peer_message("DIGEST"), TIMEOUT + 4.0).reply.step is SyncStep.OFFER  # deadline moved


def test_sync_rounds_both_ways_with_one_peer_at_once():
    m = syncer_in(INIT, HASH_SENT)
    assert deliver(m, peer_message("HASH, differs")).reply.step is SyncStep.DIGEST
    assert (m.phase(PEER, INIT), m.phase(PEER, RESP)) == (HASH_SENT, DIGEST_SENT)
    assert deliver(m, peer_message("DIGEST")).reply.step is SyncStep.OFFER
    assert (m.phase(PEER, INIT), m.phase(PEER, RESP)) == (OFFER_SENT, DIGEST_SENT)
    assert deliver(m, peer_message("OFFER")).reply.step is SyncStep.REPORTS
    assert (m.phase(PEER, INIT), m.phase(PEER, RESP)) == (OFFER_SENT, IDLE)


@pytest.mark.parametrize("role, phase, expected", [
    (INIT, HASH_SENT, "DIGEST"), (INIT, OFFER_SENT, "REPORTS"), (RESP, DIGEST_SENT, "OFFER"),
])
def test_sync_timeout_back_to_idle(role, phase, expected):
    m = syncer_in(role, phase)
    m.tick(TIMEOUT - 0.001)
    assert m.phase(PEER, role) is phase
    m.tick(TIMEOUT)
    assert m.phase(PEER, role) is IDLE
    # without a tick: the expected message is taken just before the deadline, dropped at it
    assert deliver(syncer_in(role, phase), peer_message(expected), TIMEOUT - 0.001) != SyncActions()
    m = syncer_in(role, phase)
    assert deliver(m, peer_message(expected), TIMEOUT) == SyncActions()
    assert m.phase(PEER, role) is IDLE


def _digest_items(n):
    return [[bytes([1 + i % 250, i // 250]) + bytes(30), 1] for i in range(n)]


BAD_SYNC_BODIES = {
    "oversize digest": {"phase": 1, "hash": b"", "digest": _digest_items(MAX_ENTRIES + 1), "reports": []},
    "short measurer": {"phase": 1, "hash": b"", "digest": [[b"\x02" * 31, 1]], "reports": []},
    "negative seq": {"phase": 1, "hash": b"", "digest": [[b"\x02" * 32, -1]], "reports": []},
    "one-field item": {"phase": 1, "hash": b"", "digest": [[b"\x02" * 32]], "reports": []},
    "item not a list": {"phase": 2, "hash": b"", "digest": [b"\x02" * 32], "reports": []},
    "measurer twice": {"phase": 2, "hash": b"", "digest": [[b"\x02" * 32, 1], [b"\x02" * 32, 2]], "reports": []},
    "digest not a list": {"phase": 1, "hash": b"", "digest": {}, "reports": []},
    "short hash": {"phase": 0, "hash": b"\x01" * 15, "digest": [], "reports": []},
    "HASH with a digest": {"phase": 0, "hash": b"\x01" * 16, "digest": [[b"\x02" * 32, 1]], "reports": []},
    "DIGEST with reports": {"phase": 1, "hash": b"", "digest": [], "reports": [report().to_wire()]},
    "REPORTS with a digest": {"phase": 3, "hash": b"", "digest": [[b"\x02" * 32, 1]], "reports": []},
    "DIGEST with a hash": {"phase": 1, "hash": b"\x01" * 16, "digest": [], "reports": []},
    "unknown step": {"phase": 4, "hash": b"", "digest": [], "reports": []},
}


@pytest.mark.parametrize("role, phase", [(INIT, IDLE), (INIT, HASH_SENT), (INIT, OFFER_SENT), (RESP, DIGEST_SENT)])
@pytest.mark.parametrize("bad", sorted(BAD_SYNC_BODIES))
def test_sync_malformed_message_raises_protocol_error_and_changes_nothing(role, phase, bad):
    m = syncer_in(role, phase)
    with pytest.raises(ProtocolError):
        m.handle(PEER, RecordSync.from_wire(unpack_untrusted(pack(BAD_SYNC_BODIES[bad]), max_len=1 << 20)), 0.0)
    assert m.phase(PEER, role) is phase


def test_sync_responder_sessions_are_capped():
    m = RecordSyncer(stores()[0], max_sync_bytes=1 << 20, timeout_s=TIMEOUT, max_sessions=2)
    hash_msg = peer_message("HASH, differs")
    peers = [bytes([9, i]) * 16 for i in range(3)]
    assert [m.handle(p, hash_msg, 0.0).reply is not None for p in peers] == [True, True, False]
    assert m.phase(peers[2], RESP) is IDLE
    assert m.handle(peers[0], hash_msg, 1.0).reply is not None  # a session in progress may go on
    assert m.handle(peers[2], hash_msg, TIMEOUT).reply is not None  # once one has expired


class CountingVerify:
    """A store's signature check that counts its calls."""

    def __init__(self, check=Report.verify):
        self.calls = 0
        self.check = check

    def __call__(self, r):
        self.calls += 1
        return self.check(r)


def unsigned(measurer, seq):
    return Report(measurer, seq, NOW, 0.0, (), b"\x00" * 64)


def carried(m, reports, now=0.0, src=PEER):
    """The reports of one REPORTS message from src that go on to the signature check."""
    m.start(src, now)
    return m.handle(src, RecordSync(SyncStep.REPORTS, b"", (), tuple(reports)), now).accept


async def test_a_message_of_4096_duplicates_verifies_each_distinct_report_once():
    verify = CountingVerify()
    store = RecordStore(600, verify=verify)
    m = RecordSyncer(store, max_sync_bytes=1 << 20, timeout_s=TIMEOUT)
    a, b = report(ALICE, seq=5), report(BOB, seq=3)
    forged = Report(C_ID, 9, NOW, 5.0, report(CAROL).entries, BOB.sign(b"not carol's"))
    message = [a, b, forged] * 1365 + [a]
    assert len(message) == MAX_ENTRIES
    accept = carried(m, message)
    assert accept == (a, b, forged)
    assert await offer_all(store, accept, now_wall=NOW, is_member=is_member) == [None, None, "bad signature"]
    assert verify.calls == 3
    # Again: what we hold is not newer, so only the forgery is checked again.
    assert carried(m, message, now=1.0) == (forged,)
    # One measurer's 4,096 sequence numbers: the newest alone.
    newest = report(ALICE, seq=MAX_ENTRIES + 5)
    assert carried(m, [unsigned(A_ID, s) for s in range(6, MAX_ENTRIES + 5)] + [newest], now=2.0) == (newest,)


async def test_a_flood_reaches_the_signature_check_only_up_to_the_caps():
    verify = CountingVerify(lambda r: False)
    store = RecordStore(600, verify=verify)
    limits = SyncLimits(max_reports_per_message=256, reports_per_source_per_s=256.0, burst_reports=512)
    m = RecordSyncer(store, max_sync_bytes=1 << 20, timeout_s=TIMEOUT, limits=limits)
    flood = [unsigned(i.to_bytes(32, "big"), 1) for i in range(1, MAX_ENTRIES + 1)]
    accept = carried(m, flood)
    assert accept == tuple(flood[:256])
    await offer_all(store, accept, now_wall=NOW, is_member=lambda p: True)
    assert verify.calls == 256
    assert len(carried(m, flood)) == 256  # the rest of the sender's burst
    assert len(carried(m, flood)) == 0  # spent
    assert len(carried(m, flood, now=0.5)) == 128  # refilled at 256 a second
    assert len(carried(m, flood, now=0.5, src=C_ID)) == 256  # another sender has its own budget


def test_verify_budget_refills_and_forgets_full_buckets():
    budget = VerifyBudget(rate_per_s=10.0, burst=20, max_buckets=2)
    assert budget.take(A_ID, 15, 0.0) == 15 and budget.take(A_ID, 15, 0.0) == 5
    assert budget.take(A_ID, 15, 1.0) == 10 and budget.available(A_ID, 100.0) == 20
    assert budget.take(B_ID, 1, 1.0) == 1 and budget.take(C_ID, 1, 1.0) == 1
    assert budget.take(b"\x09" * 32, 1, 5.0) == 1  # past max_buckets: the refilled ones go
    assert len(budget._buckets) <= 2 and budget.available(A_ID, 5.0) == 20
    for bad in [{"max_reports_per_message": 0}, {"burst_reports": 0}, {"reports_per_source_per_s": 0.0}]:
        with pytest.raises(ValueError):
            SyncLimits(**bad)


async def test_verification_yields_to_other_tasks_between_slices():
    verify = CountingVerify(lambda r: True)
    store = RecordStore(600, verify=verify)
    reports = [unsigned(i.to_bytes(32, "big"), 1) for i in range(1, 101)]
    me = trio.lowlevel.current_task()
    steps = []  # signatures checked in each step of this task

    class Steps(trio.abc.Instrument):
        last = 0

        def after_task_step(self, task):
            if task is me:
                steps.append(verify.calls - self.last)
                self.last = verify.calls

    seen = []  # signatures checked when the other task ran

    async def other():
        while True:
            seen.append(verify.calls)
            await trio.lowlevel.checkpoint()

    instrument = Steps()
    trio.lowlevel.add_instrument(instrument)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            reasons = await offer_all(store, reports, now_wall=NOW, is_member=lambda p: True)
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(instrument)
    assert reasons == [None] * 100 and verify.calls == 100
    assert max(steps) == 32 and sum(steps) == 100 and len([s for s in steps if s]) == 4
    assert 32 <= seen[0] < 100  # the other task ran before the batch was done


def test_two_syncers_converge_through_the_wire():
    ours, theirs = stores()
    a = RecordSyncer(ours, max_sync_bytes=1 << 20, timeout_s=TIMEOUT)
    b = RecordSyncer(theirs, max_sync_bytes=1 << 20, timeout_s=TIMEOUT)
    ends = {A_ID: (a, ours), B_ID: (b, theirs)}
    queue = [(B_ID, A_ID, a.start(B_ID, 0.0))]  # (to, from, message)
    sent = []
    while queue:
        to, src, msg = queue.pop(0)
        sent.append(msg.step)
        machine, store = ends[to]
        actions = machine.handle(src, RecordSync.from_wire(unpack_untrusted(pack(msg.to_wire()), max_len=1 << 20)), 1.0)
        for r in actions.accept:
            assert store.offer(r, now_wall=NOW, is_member=is_member) is None
        if actions.reply is not None:
            queue.append((src, to, actions.reply))
    assert sent == [SyncStep.HASH, SyncStep.DIGEST, SyncStep.OFFER, SyncStep.REPORTS]
    assert ours.digest_hash() == theirs.digest_hash() and len(ours.reports) == 3
    assert (a.phase(B_ID, INIT), b.phase(A_ID, RESP)) == (IDLE, IDLE)
    assert b.handle(A_ID, a.start(B_ID, 2.0), 2.0).reply is None  # in step: the hash is all


def _reports_from_matrix(ids, rtt, bw):
    out = {}
    for i, ident in enumerate(ids):
        entries = [Entry(ids[j].peer_id, rtt[i, j], bw[i, j], 5) for j in range(len(ids)) if j != i]
        out[ident.peer_id] = Report.create(ident, 1, NOW, 1.0, entries)
    return out


def test_view_takes_the_worse_end_and_flags_disputes_and_completeness():
    ids = [Identity(bytes([i + 1]) * 32) for i in range(3)]
    rtt = np.array([[0, 10, 20], [12, 0, 30], [20, 60, 0]], float)
    bw = np.array([[0, 1, 2], [1.2, 0, 4], [2, 4, 0]], float)
    view = build_view([i.peer_id for i in ids], _reports_from_matrix(ids, rtt, bw))
    assert view.complete
    assert view.delay_ms[0, 1] == view.delay_ms[1, 0] == 6.0  # the higher round trip, halved
    assert view.bandwidth_gbps[0, 1] == view.bandwidth_gbps[1, 0] == 1.0  # the lower bandwidth
    assert view.delay_ms[1, 2] == 30.0 and view.bandwidth_gbps[1, 2] == 4.0
    assert view.disputed_links() == [(ids[1].peer_id, ids[2].peer_id)]  # 30 against 60 ms
    assert view.as_dict()["disputed"] == [[ids[1].peer_id.hex(), ids[2].peer_id.hex()]]
    assert not view.one_sided.any() and view.as_dict()["one_sided_links"] == 0
    assert np.all(np.diag(view.delay_ms) == 0) and np.all(np.isinf(np.diag(view.bandwidth_gbps)))
    partial = build_view([i.peer_id for i in ids] + [b"\x09" * 32], _reports_from_matrix(ids, rtt, bw))
    assert not partial.complete and partial.pairs_known() == 6
    slow = view.unscaled(time_scale=2.0, bandwidth_scale=4.0)
    assert slow.delay_ms[0, 2] == 5.0 and slow.bandwidth_gbps[1, 2] == 2.0
    assert slow.disputed_links() == view.disputed_links()


def test_view_holds_each_peers_coding_speed_and_nan_where_unknown():
    ids = [Identity(bytes([i + 1]) * 32) for i in range(3)]
    a, b, c = (i.peer_id for i in ids)
    slow = tuple(100 * v for v in CODEC)
    reports = {a: Report.create(ids[0], 1, NOW, 1.0, [Entry(b, 10.0, 1.0, 3)], codec_ns=CODEC),
               b: Report.create(ids[1], 1, NOW, 1.0, [Entry(a, 12.0, 1.0, 3)], codec_ns=slow),
               c: Report.create(ids[2], 1, NOW, 1.0, [Entry(a, 12.0, 1.0, 3)])}
    view = build_view([a, b, c], reports)
    assert view.codec_ns.shape == (3, CODEC_NS_LEN)
    assert tuple(view.codec_ns[0]) == CODEC and tuple(view.codec_ns[1]) == slow
    assert np.all(np.isnan(view.codec_ns[2])) and list(view.codec_known()) == [True, True, False]
    # a report filed under another measurer speaks for nobody, its vector neither
    assert not build_view([a, b, c], {c: reports[a]}).codec_known().any()
    assert np.array_equal(view.unscaled(2.0, 4.0).codec_ns, view.codec_ns, equal_nan=True)
    assert not build_view([], {}).codec_known().any()


def test_view_takes_a_one_sided_figure_and_marks_it():
    ids = [Identity(bytes([i + 1]) * 32) for i in range(3)]
    a, b, c = (i.peer_id for i in ids)
    reports = {a: Report.create(ids[0], 1, NOW, 1.0, [Entry(b, 10.0, 0.0, 3), Entry(c, 20.0, 2.0, 3)]),
               b: Report.create(ids[1], 1, NOW, 1.0, [Entry(a, 12.0, 1.0, 3), Entry(c, 30.0, 4.0, 3)])}
    view = build_view([a, b, c], reports)
    assert view.complete and view.delay_ms[0, 1] == 6.0 and view.bandwidth_gbps[0, 1] == 1.0
    assert view.one_sided[0, 1]  # bandwidth from b only (a's probe has not run yet)
    assert view.one_sided[0, 2] and view.one_sided[2, 1] and view.as_dict()["one_sided_links"] == 3
    assert view.delay_ms[2, 0] == 10.0 and view.bandwidth_gbps[2, 1] == 4.0
