import random

import pytest
import trio

from dtfm.gossip.measure import (
    BULK_DATA,
    BULK_PULL,
    MAX_PULL_BYTES,
    BULK_RESERVE,
    BulkGate,
    BulkProbe,
    MeasurePing,
    MeasurePlanner,
    compute_speed_ms,
    measure_bandwidth,
    measure_rtt,
    probe_hash,
    serve_bulk,
    serve_ping,
)
from dtfm.gossip.messages import MsgType
from dtfm.net import ConnectionClosed, ProtocolError, RemoteError, RequestTimeout

A, B, C = (bytes([i]) * 32 for i in (1, 2, 3))


class FakeLink:
    """A PeerLink answering after a fixed delay; a transfer costs bytes / rate more."""

    def __init__(self, peer_id, rtt_s, rate_bytes_s, gate, lost=()):
        self.peer_id = peer_id
        self.rtt_s = rtt_s
        self.rate = rate_bytes_s
        self.gate = gate  # the other end's gate
        self.lost = set(lost)
        self.calls = 0

    async def request(self, msg_type, body, *, payload=None, timeout_s=None):
        self.calls += 1
        if self.calls in self.lost:
            await trio.sleep(timeout_s)
            raise RequestTimeout("lost")
        await trio.sleep(self.rtt_s + (len(payload) / self.rate if payload else 0.0))
        if msg_type == MsgType.MEASURE_PING:
            return await serve_ping(body), None
        return serve_bulk(self.gate, A, body, payload, trio.current_time(), 5.0), None


async def test_rtt_median_and_lost_pings(autojump_clock):
    link = FakeLink(B, 0.04, 1e6, BulkGate(), lost={2})
    rtts = await measure_rtt(link, 5, 0.01, timeout_s=1.0)
    assert len(rtts) == 4 and all(r == pytest.approx(0.04) for r in rtts)


async def test_pings_overlap_so_a_far_link_costs_one_round_trip_plus_the_spacing(autojump_clock):
    link = FakeLink(B, 0.4, 1e6, BulkGate())
    t0 = trio.current_time()
    rtts = await measure_rtt(link, 5, 0.05, timeout_s=1.0)
    assert len(rtts) == 5 and all(r == pytest.approx(0.4) for r in rtts)
    assert trio.current_time() - t0 == pytest.approx(0.4 + 4 * 0.05)  # (one at a time: 2.2 s)


async def test_bandwidth_from_timed_transfer_and_busy_link(autojump_clock):
    remote_gate, gate = BulkGate(), BulkGate()
    link = FakeLink(B, 0.02, 1e6, remote_gate)  # 1 MB/s = 0.008 Gbps
    gbps = await measure_bandwidth(link, gate, 500_000, rtt_s=0.05, timeout_s=5.0)
    assert gbps == pytest.approx(0.008)  # the reservation's round trip (20 ms) is subtracted
    assert not gate.probing
    # the other end is probing us: it refuses the reservation
    remote_gate.probing.add(A)
    assert await measure_bandwidth(link, gate, 500_000, rtt_s=0.02, timeout_s=5.0) is None
    # we are serving a reservation from B: no probe of our own to B
    gate.serving[B] = trio.current_time() + 5
    assert await measure_bandwidth(link, gate, 500_000, rtt_s=0.02, timeout_s=5.0) is None


class LyingLink(FakeLink):
    """A target that answers the transfer without proving it received the payload."""

    def __init__(self, answer, **kw):
        super().__init__(B, 0.02, 1e6, BulkGate(), **kw)
        self.answer = answer
        self.payloads = []

    async def request(self, msg_type, body, *, payload=None, timeout_s=None):
        if BulkProbe.from_wire(body).op == BULK_RESERVE:
            return await super().request(msg_type, body, payload=payload, timeout_s=timeout_s)
        self.payloads.append(payload)
        await trio.sleep(self.rtt_s)  # at the header, before the payload would have arrived
        return self.answer(payload), None


@pytest.mark.parametrize("answer", [
    lambda p: {"n": len(p)},  # the reply of old: counts the bytes, proves nothing
    lambda p: {"n": len(p), "hash": probe_hash(bytes(len(p)))},  # the hash of zeros
    lambda p: {"n": len(p), "hash": probe_hash(p)[:-1] + b"\x00"},
    lambda p: {"n": len(p), "hash": probe_hash(p).hex()},
    lambda p: {"n": len(p) - 1, "hash": probe_hash(p)},
    lambda p: ["n", len(p)],
], ids=["no hash", "zeros", "wrong hash", "hash as text", "wrong count", "not a map"])
async def test_a_reply_without_the_payload_hash_yields_no_bandwidth(autojump_clock, answer, caplog):
    link, gate = LyingLink(answer), BulkGate()
    assert await measure_bandwidth(link, gate, 500_000, rtt_s=0.02, timeout_s=5.0) is None
    assert not gate.probing
    assert "bandwidth probe to 02020202 discarded" in caplog.text


class RecordingLink(FakeLink):
    def __init__(self):
        super().__init__(B, 0.02, 1e6, BulkGate())
        self.payloads = []

    async def request(self, msg_type, body, *, payload=None, timeout_s=None):
        if payload is not None:
            self.payloads.append(payload)
        return await super().request(msg_type, body, payload=payload, timeout_s=timeout_s)


async def test_probe_payload_is_random_and_the_target_proves_it(autojump_clock):
    link, gate = RecordingLink(), BulkGate()
    for _ in range(2):
        assert await measure_bandwidth(link, gate, 500_000, rtt_s=0.05, timeout_s=5.0) == pytest.approx(0.008)
    first, second = link.payloads
    assert len(first) == 500_000 and first != second and first != bytes(500_000)


class RaisingLink:
    """A PeerLink whose every request fails with `error`."""

    peer_id = B

    def __init__(self, error):
        self.error = error

    async def request(self, msg_type, body, *, payload=None, timeout_s=None):
        await trio.lowlevel.checkpoint()
        raise self.error


@pytest.mark.parametrize("error", [RequestTimeout("lost"), ConnectionClosed("gone"), RemoteError("busy")])
async def test_failed_requests_lose_the_measurement(error):
    assert await measure_rtt(RaisingLink(error), 3, 0.0, timeout_s=1.0) == []
    gate = BulkGate()
    assert await measure_bandwidth(RaisingLink(error), gate, 1000, rtt_s=0.01, timeout_s=1.0) is None
    assert not gate.probing


async def test_a_bug_below_the_measurement_is_not_swallowed():
    with pytest.raises(TypeError):
        await measure_rtt(RaisingLink(TypeError("bug")), 3, 0.0, timeout_s=1.0)
    gate = BulkGate()
    with pytest.raises(TypeError):
        await measure_bandwidth(RaisingLink(TypeError("bug")), gate, 1000, rtt_s=0.01, timeout_s=1.0)
    assert not gate.probing  # the link is released all the same


def test_serve_bulk_checks_fields_and_payload():
    gate = BulkGate()
    assert serve_bulk(gate, B, {"op": BULK_RESERVE, "n": 10}, None, 0.0, 5.0) == {"ok": True}
    assert gate.busy(B, 1.0) and not gate.busy(B, 6.0)
    reply = serve_bulk(gate, B, {"op": BULK_DATA, "n": 10}, b"x" * 10, 1.0, 5.0)
    assert reply == {"n": 10, "hash": probe_hash(b"x" * 10)} and len(reply["hash"]) == 16
    assert not gate.busy(B, 1.0)
    for body, payload in [({"op": BULK_DATA, "n": 10}, b"x" * 9), ({"op": 7, "n": 10}, None),
                          ({"op": BULK_DATA, "n": -1}, b""), ([1], None), ({"op": BULK_DATA, "n": 3}, None)]:
        with pytest.raises(ProtocolError):
            serve_bulk(gate, B, body, payload, 0.0, 5.0)


def test_planner_order_rate_limit_and_remeasure():
    p = MeasurePlanner(remeasure_s=100.0, bulk_interval_s=2.0, jitter=0.25, rng=random.Random(1))
    first = p.next_target([B, C], 0.0)
    p.record(first, [0.01, 0.03, 0.02], 1.5, 0.0)
    assert 1.5 <= p.bulk_wait_s(0.0) <= 2.5
    second = p.next_target([B, C], 1.0)
    assert second != first
    p.record(second, [0.02], None, 1.0)  # link was busy: rtt only, stays a candidate
    assert p.next_target([B, C], 2.0) == second
    p.record(second, [0.02], 1.0, 2.0)
    assert p.next_target([B, C], 50.0) is None
    assert p.next_target([B, C], 100.0) == first  # stalest first once due
    entries = {e.target: e for e in p.entries()}
    assert entries[first].rtt_ms == pytest.approx(20.0) and entries[first].samples == 3
    p.forget(first)
    assert first not in {e.target for e in p.entries()}


def test_compute_speed_probe_runs_one_block():
    ms = compute_speed_ms(d_model=32, n_heads=2, seq_len=8, batch=2, repeats=1)
    assert ms > 0


def test_measurement_messages_roundtrip_and_refuse_garbage():
    assert MeasurePing.from_wire(MeasurePing(3).to_wire()) == MeasurePing(3)
    assert BulkProbe.from_wire(BulkProbe(BULK_DATA, 10).to_wire()) == BulkProbe(BULK_DATA, 10)
    for bad in [None, [], {"n": -1}, {"n": "1"}, {"n": 1.0}]:
        with pytest.raises(ProtocolError):
            MeasurePing.from_wire(bad)
    assert BulkProbe.from_wire({"op": BULK_PULL, "n": 1}) == BulkProbe(BULK_PULL, 1)
    for bad in [{"op": 3, "n": 1}, {"op": 0, "n": 0}, {"op": 0}, {"op": 0, "n": 2**40},
                {"op": BULK_PULL, "n": MAX_PULL_BYTES + 1}]:
        with pytest.raises(ProtocolError):
            BulkProbe.from_wire(bad)
