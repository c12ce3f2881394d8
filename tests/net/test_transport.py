import functools
import logging

import pytest
import trio
import trio.testing

from dtfm.net import Reply, Transport, TransportConfig, frames
from dtfm.net.errors import ConnectionClosed, HandshakeError, RemoteError, RequestTimeout
from dtfm.net.handshake import Initiator, PeerHello
from dtfm.net.identity import Identity, swarm_key_fingerprint
from dtfm.net.session import encode_prefix

KEY = bytes(range(32))
ECHO = 40
NOTE = 41
SLOW = 42
BAD = 43


def make(region="", key=KEY, config=None, **kw):
    t = Transport(Identity.generate(), key, config or TransportConfig.test(), region=region, **kw)

    async def echo(conn, msg_type, body, payload):
        return Reply(body, payload)

    async def slow(conn, msg_type, body, payload):
        await trio.sleep_forever()

    t.handle(ECHO, echo)
    t.handle(SLOW, slow)
    return t


async def start_tcp(nursery, *transports):
    addrs = []
    for t in transports:
        addrs.append(await nursery.start(t.serve, "127.0.0.1", 0))
    return addrs


async def test_request_reply_payload_and_registry():
    a, b = make("eu"), make("us")
    connected, disconnected = [], []
    gone = trio.Event()
    b.on_connect(connected.append)
    b.on_disconnect(lambda c, r: (disconnected.append(r), gone.set()))
    async with trio.open_nursery() as n:
        _, (host, port) = await start_tcp(n, a, b)
        conn = await a.connect(host, port)
        assert conn.peer_id == b.peer_id and conn.region == "us"
        assert conn.listen_address == (host, port)
        assert await a.connect(host, port) is conn  # reused
        assert a.connection(b.peer_id) is conn and a.connections() == [conn]
        payload = bytes(range(256)) * 4000  # several chunks in the test profile
        body, got = await conn.request(ECHO, {"k": [1, 2.5, "s"]}, payload=payload)
        assert body == {"k": [1, 2.5, "s"]} and bytes(got) == payload
        body, got = await conn.request(ECHO, None)
        assert body is None and got is None
        assert [c.peer_id for c in connected] == [a.peer_id]
        back = b.connection(a.peer_id)
        assert back.region == "eu" and back.listen_address == a.listen_address
        await conn.close("bye now")
        assert conn.closed and a.connection(b.peer_id) is None
        with trio.fail_after(5):
            await gone.wait()
        assert "bye now" in disconnected[0]
        with pytest.raises(ConnectionClosed):
            await conn.send(NOTE, {})
        n.cancel_scope.cancel()


async def test_one_way_messages_arrive_in_order():
    a, b = make(), make()
    got = []
    done = trio.Event()

    async def note(conn, msg_type, body, payload):
        got.append(body)
        if len(got) == 200:
            done.set()

    b.handle(NOTE, note)
    async with trio.open_nursery() as n:
        _, (host, port) = await start_tcp(n, a, b)
        conn = await a.connect(host, port)
        for i in range(200):  # > rekey_after_records of the test profile: keys renew on the way
            await conn.send(NOTE, i)
        with trio.fail_after(10):
            await done.wait()
        assert sorted(got) == list(range(200))
        assert conn._out.cipher.counter < TransportConfig.test().rekey_after_records + 1
        n.cancel_scope.cancel()


async def test_wrong_swarm_key_refused_without_telling_the_key(caplog):
    a, b = make(key=bytes(32)), make()
    caplog.set_level(logging.DEBUG, logger="dtfm.net.transport")
    async with trio.open_nursery() as n:
        _, (host, port) = await start_tcp(n, a, b)
        for _ in range(3):  # a peer that retries with the wrong key
            with pytest.raises(HandshakeError, match="refused by peer: handshake refused") as e:
                await a.connect(host, port)
            assert swarm_key_fingerprint(KEY) not in str(e.value)
        # the refusing side keeps the reason for its operator: one WARNING a minute per host, with
        # the remote address; the retries within the minute are counted, not logged
        warnings = [r.getMessage() for r in caplog.records
                    if r.levelno == logging.WARNING and r.name == "dtfm.net.transport"]
        assert len(warnings) == 1, warnings
        assert warnings[0].startswith("refused handshake from 127.0.0.1:")
        assert f"swarm key mismatch: the connecting peer does not hold this swarm's key (ours has fingerprint " \
               f"{swarm_key_fingerprint(KEY)})" in warnings[0]
        assert b.connections() == [] and a.connections() == []
        n.cancel_scope.cancel()


async def test_unknown_type_and_handler_errors():
    a, b = make(), make()

    async def broken(conn, msg_type, body, payload):
        raise RuntimeError("boom")

    async def huge(conn, msg_type, body, payload):
        return "x" * (1 << 20)  # over max_control_frame_bytes of the test profile

    b.handle(BAD, broken)
    b.handle(NOTE, huge)
    async with trio.open_nursery() as n:
        _, (host, port) = await start_tcp(n, a, b)
        conn = await a.connect(host, port)
        with pytest.raises(RemoteError, match="unknown message type 77"):
            await conn.request(77, {})
        with pytest.raises(RemoteError, match="internal error"):
            await conn.request(BAD, {})
        with pytest.raises(RemoteError, match="not encodable"):
            await conn.request(NOTE, {})
        assert (await conn.request(ECHO, 1))[0] == 1  # still connected
        n.cancel_scope.cancel()


async def test_ping_overtakes_a_large_transfer():
    a, b = make(), make()
    events = []
    bulk_done = trio.Event()

    async def sink(conn, msg_type, body, payload):
        events.append("bulk received")
        return None

    b.handle(NOTE, sink)
    async with trio.open_nursery() as n:
        _, (host, port) = await start_tcp(n, a, b)
        conn = await a.connect(host, port)
        big = bytes(48 << 20)

        async def bulk():
            await conn.request(NOTE, {}, payload=big, timeout_s=60)
            events.append("bulk done")
            bulk_done.set()

        n.start_soon(bulk)
        while conn._out.cipher.counter < 20:  # the transfer is under way
            await trio.sleep(0)
        await conn.ping(timeout_s=30)
        events.append("ping")
        with trio.fail_after(60):
            await bulk_done.wait()
        assert events == ["ping", "bulk received", "bulk done"]
        n.cancel_scope.cancel()


def test_config_validation():
    with pytest.raises(ValueError):
        TransportConfig(keepalive_interval_s=10, idle_timeout_s=15)
    with pytest.raises(ValueError):
        TransportConfig(max_payload_bytes=10, max_inflight_payload_bytes=5)
    with pytest.raises(ValueError):
        TransportConfig(request_timeout_s=0)
    with pytest.raises(ValueError):
        TransportConfig(max_payload_bytes=10, max_total_payload_bytes=5)
    for name in ("hello_timeout_s", "handshake_clock_skew_s"):
        with pytest.raises(ValueError):
            TransportConfig(**{name: 0})
    for name in ("max_half_open_per_host", "max_pending_connections", "max_pending_per_host"):
        with pytest.raises(ValueError):
            TransportConfig(**{name: 0})
    with pytest.raises(ValueError):
        make().handle(0, None)


# ---- deterministic tests over in-memory streams and a mock clock ---------------------------


async def pair(nursery, a, b, remote=("10.0.0.1", 5000)):
    await nursery.start(a.run)
    await nursery.start(b.run)
    left, right = trio.testing.memory_stream_pair()
    nursery.start_soon(b.accept_stream, right, remote)
    return await a.connect_stream(left, ("10.0.0.2", 7000))


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_request_timeout_is_exact(autojump_clock):
    a, b = make(), make()
    async with trio.open_nursery() as n:
        conn = await pair(n, a, b)
        t0 = trio.current_time()
        with pytest.raises(RequestTimeout):
            await conn.request(SLOW, {}, timeout_s=3.5)
        assert trio.current_time() - t0 == pytest.approx(3.5)
        with pytest.raises(RequestTimeout):
            await conn.request(SLOW, {})
        assert trio.current_time() - t0 == pytest.approx(3.5 + TransportConfig.test().request_timeout_s)
        n.cancel_scope.cancel()


async def test_keepalive_holds_idle_connection_and_keys_renew_on_timer(autojump_clock):
    a, b = make(), make()
    async with trio.open_nursery() as n:
        conn = await pair(n, a, b)
        await trio.sleep(120)  # 12 idle timeouts of silence, bridged by keepalives
        assert not conn.closed and b.connection(a.peer_id) is not None
        assert conn._out.last_rekey >= 110  # renewed on the timer (every 10 s in the test profile)
        assert (await conn.request(ECHO, "still here"))[0] == "still here"
        n.cancel_scope.cancel()


async def test_silent_peer_times_out(autojump_clock):
    a = make()
    async with trio.open_nursery() as n:
        await n.start(a.run)
        left, right = trio.testing.memory_stream_pair()
        with pytest.raises(HandshakeError, match="timed out"):
            await a.connect_stream(left, ("10.0.0.9", 1))
        assert trio.current_time() == pytest.approx(TransportConfig.test().handshake_timeout_s)
        n.cancel_scope.cancel()


async def test_crossed_dials_leave_one_connection(autojump_clock):
    a, b = make(), make()
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await n.start(b.run)
        l1, r1 = trio.testing.memory_stream_pair()
        l2, r2 = trio.testing.memory_stream_pair()
        n.start_soon(b.accept_stream, r1, ("10.0.0.1", 1))
        n.start_soon(a.accept_stream, r2, ("10.0.0.2", 2))
        async with trio.open_nursery() as dial:
            dial.start_soon(a.connect_stream, l1, ("10.0.0.2", 2))
            dial.start_soon(b.connect_stream, l2, ("10.0.0.1", 1))
        await trio.sleep(1)
        ca, cb = a.connections(), b.connections()
        assert len(ca) == 1 and len(cb) == 1
        assert ca[0].initiator_id == cb[0].initiator_id == min(a.peer_id, b.peer_id)
        assert (await ca[0].request(ECHO, 5))[0] == 5
        n.cancel_scope.cancel()


def accept(nursery, server, host):
    """A connection to `server` from `host`; the client's end of it."""
    left, right = trio.testing.memory_stream_pair()
    nursery.start_soon(server.accept_stream, right, (host, 1))
    return left


async def stalled_hello(nursery, server, host):
    """A swarm member that sends a valid hello and then nothing: it holds a handshake slot."""
    left = accept(nursery, server, host)
    msg1 = Initiator(Identity.generate(), KEY, PeerHello("", ("", 0))).first_message()
    await left.send_all(encode_prefix(len(msg1)) + msg1)
    return left


FLOOD = TransportConfig(**{
    **TransportConfig.test().__dict__, "handshake_rate_per_s": 1.0, "handshake_burst": 3,
    "max_half_open_handshakes": 5, "max_half_open_per_host": 3, "max_pending_connections": 8,
    "max_pending_per_host": 4, "hello_timeout_s": 1.0, "handshake_timeout_s": 2.0,
})


async def good_handshake(nursery, server, good, host="10.0.0.1"):
    conn = await good.connect_stream(accept(nursery, server, host), ("server", 1))
    assert (await conn.request(ECHO, "ok"))[0] == "ok"
    await conn.close()


async def test_silent_connections_hold_no_handshake_slot_and_expire(autojump_clock):
    server, good = make(config=FLOOD), make()
    async with trio.open_nursery() as n:
        await n.start(server.run)
        await n.start(good.run)
        silent = [accept(n, server, "10.6.6.6") for _ in range(10)]
        await trio.testing.wait_all_tasks_blocked()
        assert (server._admission.pending, server._admission.half_open) == (4, 0)  # its share of pending
        await good_handshake(n, server, good)  # not blocked by them
        silent += [accept(n, server, "2001:db8::%d" % i) for i in range(1, 10)]  # one /64: one source
        await trio.testing.wait_all_tasks_blocked()
        assert server._admission.pending == 8 and trio.current_time() < FLOOD.hello_timeout_s
        with pytest.raises(HandshakeError, match="closed the connection during the handshake"):
            await good.connect_stream(accept(n, server, "10.0.0.1"), ("server", 1))  # pending is full
        await trio.sleep_until(FLOOD.hello_timeout_s)
        await trio.testing.wait_all_tasks_blocked()
        assert server._admission.pending == 0  # closed at the hello timeout
        assert [await s.receive_some(1) for s in silent] == [b""] * len(silent)
        await good_handshake(n, server, good)
        n.cancel_scope.cancel()


async def test_stalled_handshakes_are_capped_per_source_and_overall(autojump_clock):
    server, good = make(config=FLOOD), make()
    async with trio.open_nursery() as n:
        await n.start(server.run)
        await n.start(good.run)
        for i in range(6):  # one IPv6 /64: only its share of 3 slots
            await stalled_hello(n, server, f"2001:db8::{i + 1}")
        await trio.testing.wait_all_tasks_blocked()
        assert server._admission.half_open == 3
        await good_handshake(n, server, good)  # two slots are left for others
        for i in range(3):  # a second source fills the global cap of 5
            await stalled_hello(n, server, "10.8.8.8")
        await trio.testing.wait_all_tasks_blocked()
        assert server._admission.half_open == 5
        with pytest.raises(HandshakeError, match="closed the connection during the handshake"):
            await good.connect_stream(accept(n, server, "10.0.0.1"), ("server", 1))
        await trio.sleep(FLOOD.handshake_timeout_s + 0.1)  # the stalled handshakes expire
        assert server._admission.half_open == 0
        await good_handshake(n, server, good, host="10.0.0.2")
        stranger = make(key=bytes(32))
        await n.start(stranger.run)
        for _ in range(3):  # refused hellos free their slot at once, but each took a token
            with pytest.raises(HandshakeError, match="handshake refused"):
                await stranger.connect_stream(accept(n, server, "10.5.5.5"), ("server", 1))
        assert server._admission.half_open == 0
        with pytest.raises(HandshakeError, match="closed the connection during the handshake"):
            await good.connect_stream(accept(n, server, "10.5.5.5"), ("server", 1))  # no token left
        await trio.sleep(1.0)
        await good_handshake(n, server, good, host="10.5.5.5")
        n.cancel_scope.cancel()


class DelayShaper:
    """Delays every frame by a fixed latency and drops every droppable frame."""

    def __init__(self, latency_s):
        self.latency_s = latency_s
        self.links = []

    def open_link(self, peer_id, region):
        self.links.append((peer_id, region))
        return DelayShape(self.latency_s)


class DelayShape:
    def __init__(self, latency_s):
        self.latency_s = latency_s
        self.dropped = 0
        self._send, self._recv = trio.open_memory_channel(1000)

    async def submit(self, frame, droppable):
        if droppable:
            self.dropped += 1
            return
        await self._send.send((trio.current_time() + self.latency_s, frame))

    async def run(self, transmit):
        async for due, frame in self._recv:
            await trio.sleep_until(due)
            await transmit(frame)


async def test_link_shaper_sees_every_frame(autojump_clock):
    sa, sb = DelayShaper(0.05), DelayShaper(0.02)
    a, b = make("eu", shaper=sa), make("us", shaper=sb)
    got = []

    async def note(conn, msg_type, body, payload):
        got.append(body)

    b.handle(NOTE, note)
    async with trio.open_nursery() as n:
        conn = await pair(n, a, b)
        assert sa.links == [(b.peer_id, "us")] and sb.links == [(a.peer_id, "eu")]
        assert await conn.ping() == pytest.approx(0.07)
        body, payload = await conn.request(ECHO, "x", payload=bytes(300_000))
        assert len(payload) == 300_000
        await conn.send(NOTE, "dropped", droppable=True)
        for i in range(100):  # well past the rekey threshold: dropped frames took no nonce
            await conn.send(NOTE, i)
        await trio.sleep(1)
        assert got == list(range(100))
        n.cancel_scope.cancel()


@pytest.mark.parametrize("shaper", [None, DelayShaper(0.05)], ids=["priority", "delayed"])
async def test_messages_sent_before_close_arrive_before_it(autojump_clock, shaper):
    # A goodbye sent just before close() (a peer leaving) is not overtaken by the CLOSE frame.
    a, b = make(shaper=shaper), make()
    got, why = [], []
    gone = trio.Event()

    async def note(conn, msg_type, body, payload):
        got.append(body)

    b.handle(NOTE, note)
    b.on_disconnect(lambda c, r: (why.append(r), gone.set()))
    async with trio.open_nursery() as n:
        conn = await pair(n, a, b)
        for i in range(20):
            await conn.send(NOTE, i)
        await conn.close("leaving")
        with trio.fail_after(5):
            await gone.wait()
        assert got == list(range(20)) and "leaving" in why[0]
        n.cancel_scope.cancel()


async def test_large_records_sealed_and_opened_on_worker_threads():
    cfg = TransportConfig(
        **{
            **TransportConfig.test().__dict__,
            "chunk_bytes": 1 << 20,
            "rekey_after_records": 3,
            "crypto_thread_min_bytes": 128 * 1024,
        }
    )
    a, b = make(config=cfg), make(config=cfg)
    payload = bytes(range(251)) * 25_000 + b"tail"  # ~6 MiB in 1 MiB records, keys renewed on the way
    async with trio.open_nursery() as n:
        _, (host, port) = await start_tcp(n, a, b)
        conn = await a.connect(host, port)
        async with trio.open_nursery() as many:  # concurrent transfers interleave their chunks
            for i in range(3):
                async def one(i=i):
                    body, got = await conn.request(ECHO, i, payload=payload[i:])
                    assert body == i and bytes(got) == payload[i:]
                many.start_soon(one)
        n.cancel_scope.cancel()


async def test_chacha_fallback_when_one_side_lacks_aegis():
    chacha_only = TransportConfig(**{**TransportConfig.test().__dict__, "cipher_suites": ("chacha20poly1305",)})
    a, b = make(config=chacha_only), make()
    async with trio.open_nursery() as n:
        _, (host, port) = await start_tcp(n, a, b)
        conn = await a.connect(host, port)
        assert conn.cipher_suite == "chacha20poly1305"
        assert b.connection(a.peer_id).cipher_suite == "chacha20poly1305"
        body, got = await conn.request(ECHO, "x", payload=bytes(range(256)) * 1000)
        assert body == "x" and bytes(got) == bytes(range(256)) * 1000
        n.cancel_scope.cancel()
    with pytest.raises(ValueError):
        TransportConfig(cipher_suites=("rot13",))


async def test_peer_silent_after_handshake_is_dropped_at_idle_timeout(autojump_clock):
    from dtfm.net.handshake import Initiator, PeerHello
    from dtfm.net.session import encode_prefix
    from dtfm.net.streamio import StreamReader

    server = make()
    gone = trio.Event()
    closed_at = []
    server.on_disconnect(lambda c, r: (closed_at.append((trio.current_time(), r)), gone.set()))
    async with trio.open_nursery() as n:
        await n.start(server.run)
        left, right = trio.testing.memory_stream_pair()
        n.start_soon(server.accept_stream, right, ("10.0.0.5", 1))
        init = Initiator(Identity.generate(), KEY, PeerHello("", ("", 0)))
        msg1 = init.first_message()
        await left.send_all(encode_prefix(len(msg1)) + msg1)
        reader = StreamReader(left)
        size = int.from_bytes(await reader.read_exactly(4), "big")
        msg3, _ = init.on_response(bytes(await reader.read_exactly(size)))
        await left.send_all(encode_prefix(len(msg3)) + msg3)
        t0 = trio.current_time()
        await gone.wait()  # we never send another byte (nor read the server's keepalives)
        elapsed, reason = closed_at[0][0] - t0, closed_at[0][1]
        assert elapsed == pytest.approx(TransportConfig.test().idle_timeout_s, abs=0.01)
        assert "nothing received" in reason
        n.cancel_scope.cancel()


# ---- payloads given up part-way, and the transport-wide payload budget ----------------------


class OneLaneShaper:
    """Every frame in one FIFO; `hold` (an Event) keeps back every chunk after the first until
    it is set, `chunk_s` spaces chunks out."""

    def __init__(self, chunk_s=0.0, hold=None):
        self.chunk_s = chunk_s
        self.hold = hold
        self.sent = []

    def open_link(self, peer_id, region):
        return OneLane(self)


class OneLane:
    def __init__(self, shaper):
        self.shaper = shaper
        self._send, self._recv = trio.open_memory_channel(0)

    async def submit(self, frame, droppable):
        await self._send.send(frame)

    async def run(self, transmit):
        chunks = 0
        async for frame in self._recv:
            if frame[0] == frames.CHUNK:
                chunks += 1
                if chunks > 1 and self.shaper.hold is not None:
                    await self.shaper.hold.wait()
                await trio.sleep(self.shaper.chunk_s)
            self.shaper.sent.append(frame[0])
            await transmit(frame)


def inbound_of(transport, peer_id):
    return transport.connection(peer_id)._inbound


async def test_payload_given_up_mid_send_is_aborted_and_freed(autojump_clock):
    cfg = TransportConfig.test()
    shaper = OneLaneShaper(chunk_s=0.1)
    a, b = make(shaper=shaper), make()
    async with trio.open_nursery() as n:
        conn = await pair(n, a, b)
        payload = bytes(10 * cfg.chunk_bytes)  # a second to send
        for _ in range(2 * cfg.max_inflight_payloads):  # a slow bandwidth probe, over and over
            with pytest.raises(RequestTimeout):
                await conn.request(ECHO, "probe", payload=payload, timeout_s=0.35)
        await trio.sleep(0.5)
        assert shaper.sent.count(frames.ABORT) == 2 * cfg.max_inflight_payloads
        inbound = inbound_of(b, a.peer_id)
        assert inbound.inflight_bytes == 0 and b._payload_budget.used_bytes == 0
        assert not conn.closed
        body, got = await conn.request(ECHO, "whole", payload=payload[:3 * cfg.chunk_bytes])
        assert body == "whole" and len(got) == 3 * cfg.chunk_bytes
        n.cancel_scope.cancel()


BUDGET = TransportConfig(**{
    **TransportConfig.test().__dict__, "max_payload_bytes": 512 * 1024,
    "max_inflight_payload_bytes": 512 * 1024, "max_total_payload_bytes": 768 * 1024,
})


async def test_payload_budget_is_shared_by_all_connections(autojump_clock, caplog):
    caplog.set_level(logging.WARNING, logger="dtfm.net")
    hold = trio.Event()
    server = make(config=BUDGET)
    slow, other = make(config=BUDGET, shaper=OneLaneShaper(hold=hold)), make(config=BUDGET)
    big = bytes(range(256)) * 2048  # 512 KiB
    async with trio.open_nursery() as n:
        for t in (server, slow, other):
            await n.start(t.run)
        slow_conn = await slow.connect_stream(accept(n, server, "10.0.0.1"), ("server", 1))
        other_conn = await other.connect_stream(accept(n, server, "10.0.0.2"), ("server", 1))
        done = trio.Event()

        async def slow_request():
            body, got = await slow_conn.request(ECHO, "slow", payload=big, timeout_s=60)
            assert bytes(got) == big
            done.set()

        n.start_soon(slow_request)
        await trio.testing.wait_all_tasks_blocked()
        assert server._payload_budget.used_bytes == len(big)  # held by the stalled payload
        with pytest.raises(RemoteError, match=r"payload of 524288 bytes refused: .*payload budget"):
            await other_conn.request(ECHO, "big", payload=big)
        assert any("payload budget" in r.getMessage() and other.identity.short_id in r.getMessage()
                   for r in caplog.records)
        assert server._payload_budget.used_bytes == len(big) and not other_conn.closed
        assert bytes((await other_conn.request(ECHO, "fits", payload=big[:200_000]))[1]) == big[:200_000]
        hold.set()
        await done.wait()
        assert server._payload_budget.used_bytes == 0
        assert bytes((await other_conn.request(ECHO, "now", payload=big))[1]) == big
        # a connection that closes with a payload half received gives its share back
        hold2 = slow._shaper.hold = trio.Event()
        n.start_soon(_expect_closed, slow_conn.request(ECHO, "again", payload=big, timeout_s=60))
        await trio.testing.wait_all_tasks_blocked()
        assert server._payload_budget.used_bytes == len(big)
        await server.connection(slow.peer_id).close("bye")
        assert server._payload_budget.used_bytes == 0
        hold2.set()
        n.cancel_scope.cancel()


async def _expect_closed(coro):
    with pytest.raises(ConnectionClosed):
        await coro


def test_inbound_abort_refusal_and_close_keep_the_accounting():
    from dtfm.net.budget import PayloadBudget
    from dtfm.net.errors import ProtocolError
    from dtfm.net.wire import pack

    budget = PayloadBudget(100)
    one, two = (frames.Inbound(max_control_frame_bytes=1024, max_payload_bytes=100, max_inflight_payload_bytes=100,
                               max_inflight_payloads=2, budget=budget) for _ in range(2))

    def header(msg_id, n):
        return frames.encode_msg(40, frames.FLAG_REQUEST, msg_id, 0, pack(None), n)

    assert one.on_frame(header(1, 60)) is None
    refused = two.on_frame(header(1, 60))  # the other connection's payload does not fit
    assert refused.payload is None and "payload budget (60 of 100 bytes in use)" in refused.refused
    assert (refused.msg_id, refused.flags) == (1, frames.FLAG_REQUEST)  # so the request can be answered
    assert one.on_frame(frames.encode_abort(1)) is None  # given up: freed
    assert budget.used_bytes == 0 and one.inflight_bytes == 0
    assert two.on_frame(frames.encode_abort(1)) is None  # a refused one can be given up too
    with pytest.raises(ProtocolError, match="abort for unknown message id 1"):
        one.on_frame(frames.encode_abort(1))
    with pytest.raises(ProtocolError, match="malformed abort"):
        one.on_frame(frames.encode_abort(7) + b"x")
    assert one.on_frame(header(2, 40)) is None and two.on_frame(header(2, 60)) is None
    assert budget.used_bytes == 100
    assert "payload budget" in two.on_frame(header(3, 1)).refused
    with pytest.raises(ProtocolError, match="more than 2 payloads in flight"):  # refused ones count too
        two.on_frame(header(4, 1))
    two.close()  # its connection went away
    assert budget.used_bytes == 40 and two.inflight_bytes == 0
    one.close()
    assert budget.used_bytes == 0


async def test_record_buffers_grown_by_large_records_shrink_once_they_stop(autojump_clock):
    """A connection that carried one large payload and a large control frame (a bandwidth probe,
    a stage transfer) keeps its first buffers once nothing that large passed for 30 s; while
    large records keep coming, the grown buffers stay."""
    from dtfm.net.records import SHRINK_AFTER_S

    a, b = make(config=TransportConfig.default()), make(config=TransportConfig.default())  # 1 MiB chunks
    async with trio.open_nursery() as n:
        conn = await pair(n, a, b)
        small = conn.record_buffer_bytes
        big = {"blob": "x" * 200_000}  # a large control frame: each side's record buffer grows
        for _ in range(3):
            await conn.request(ECHO, big, payload=bytes(300_000))
            await trio.sleep(SHRINK_AFTER_S / 3)
        back = b.connection(a.peer_id)
        grown = (conn.record_buffer_bytes, back.record_buffer_bytes)
        assert min(grown) > 200_000  # kept while large records recur
        await trio.sleep(SHRINK_AFTER_S)
        for _ in range(2):  # each of the two output buffers shrinks at its next record
            assert (await conn.request(ECHO, "small"))[0] == "small"
        assert conn.record_buffer_bytes == back.record_buffer_bytes == small
        assert (await conn.request(ECHO, big))[0] == big  # and grows again when needed
        n.cancel_scope.cancel()


async def test_concurrent_dials_to_one_peer_share_one_connection():
    """Tasks that dial one peer at once (a hand-out's request beside a data-plane connect) get
    one connection: a second dial from the same side would replace the first as a duplicate and
    cut the requests in flight on it."""
    a, b = make(), make()
    closed = []
    a.on_disconnect(lambda c, r: closed.append(r))
    async with trio.open_nursery() as n:
        _, (host, port) = await start_tcp(n, a, b)
        got = []

        async def dial(by_id: bool):
            got.append(await a.connect(host, port, peer_id=b.peer_id if by_id else None))

        async with trio.open_nursery() as dials:
            for k in range(6):
                dials.start_soon(dial, k % 2 == 0)
        assert len({id(c) for c in got}) == 1 and a.connections() == got[:1]
        body, _ = await got[0].request(ECHO, {"alive": True})
        assert body == {"alive": True} and closed == []
        await a.aclose()
        await b.aclose()
        n.cancel_scope.cancel()


async def test_a_dial_stuck_in_its_handshake_holds_the_next_one_until_it_fails(autojump_clock):
    """A handshake the other end never answers holds the next dial to that address until it
    fails (its handshake timeout): then that one dials itself, never two at once."""
    import dataclasses

    a = make(config=dataclasses.replace(TransportConfig.test(), handshake_timeout_s=10.0))
    accepted = []

    async def silent(stream):
        accepted.append(trio.current_time())
        await trio.sleep_forever()

    async with trio.open_nursery() as n:
        await n.start(a.run)
        [listener] = await n.start(functools.partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        failed = []

        async def dial():
            with pytest.raises(HandshakeError):
                await a.connect("127.0.0.1", port)
            failed.append(trio.current_time())

        t0 = trio.current_time()
        async with trio.open_nursery() as dials:
            dials.start_soon(dial)
            await trio.sleep(0.1)
            dials.start_soon(dial)
        assert [t - t0 for t in accepted] == pytest.approx([0.0, 10.0], abs=0.05)
        assert [t - t0 for t in failed] == pytest.approx([10.0, 20.0], abs=0.05)
        n.cancel_scope.cancel()


async def test_a_duplicate_connection_is_retired_after_what_is_in_flight_on_it():
    """Both ends dial each other: the connection dialled by the smaller id survives, and the
    other one, retired, still carries the reply to a request in flight on it before it closes."""
    a, b = make(), make()
    while not b.peer_id < a.peer_id:  # (b's dial must win, so a's first connection loses)
        a, b = make(), make()
    release = trio.Event()
    answered = []

    async def held(conn, msg_type, body, payload):
        await release.wait()
        return Reply({"held": body}, None)

    b.handle(NOTE, held)
    async with trio.open_nursery() as n:
        (ha, pa), (hb, pb) = await start_tcp(n, a, b)
        first = await a.connect(hb, pb)

        async def ask():
            answered.append(await first.request(NOTE, 7, timeout_s=5.0))

        n.start_soon(ask)
        await trio.testing.wait_all_tasks_blocked()
        second = await b.connect(ha, pa)  # (b never dialled a's address: a new connection)
        assert second.initiator_id == b.peer_id and b.connection(a.peer_id) is second
        with trio.fail_after(5):
            while a.connection(b.peer_id) is not first and a.connection(b.peer_id) is None:
                await trio.sleep(0.01)
        assert not first.closed  # retired, not cut: a's request is still in flight on it
        release.set()
        with trio.fail_after(5):
            while not answered or not first.closed:
                await trio.sleep(0.01)
        assert answered == [({"held": 7}, None)] and first.close_reason.endswith("duplicate connection")
        await a.aclose()
        await b.aclose()
        n.cancel_scope.cancel()
