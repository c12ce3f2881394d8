"""The transport contract (`dtfm.net.interface`), run against both implementations: two TCP
`Transport`s on loopback (real time) and two `MemTransport`s on a `MemNetwork` (MockClock).

Every test here uses only the interface plus construction, so a behaviour that passes for one
implementation and fails for the other is a bug in one of them."""

from __future__ import annotations

import array
import inspect
import logging
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from dtfm.net import (
    Connection,
    ConnectionClosed,
    HandshakeError,
    Identity,
    MemConnection,
    MemNetwork,
    MemTransport,
    PeerConnection,
    PeerTransport,
    ProtocolError,
    Refusals,
    RemoteError,
    Reply,
    RequestTimeout,
    Transport,
    TransportConfig,
    short_id,
    uniform_link,
)

KEY = bytes(range(32))
CONFIG = TransportConfig(**{**TransportConfig.test().__dict__, "request_timeout_s": 0.5,
                            "max_concurrent_handlers": 4})
ECHO, NOTE, SLOW, BAD, CRASH, FAIL, HUGE, LATE = range(40, 48)


@dataclass
class Side:
    """One transport, with what its handlers and callbacks saw."""

    t: PeerTransport
    notes: list = field(default_factory=list)
    slow_running: int = 0
    slow_started: trio.Event = field(default_factory=trio.Event)
    late_started: trio.Event = field(default_factory=trio.Event)
    release: trio.Event = field(default_factory=trio.Event)
    connected: list = field(default_factory=list)
    arrived: trio.Event = field(default_factory=trio.Event)
    disconnected: list = field(default_factory=list)
    gone: trio.Event = field(default_factory=trio.Event)
    note_count: trio.Event = field(default_factory=trio.Event)
    notes_wanted: int = 1

    def install(self) -> None:
        self.t.on_connect(self._on_connect)
        self.t.on_disconnect(self._on_disconnect)
        for msg_type, handler in ((ECHO, self.echo), (NOTE, self.note), (SLOW, self.slow), (BAD, self.bad),
                                  (CRASH, self.crash), (FAIL, self.fail), (HUGE, self.huge), (LATE, self.late)):
            self.t.handle(msg_type, handler)

    def _on_connect(self, conn):
        self.connected.append(conn)
        self.arrived.set()

    def _on_disconnect(self, conn, reason):
        self.disconnected.append((conn, reason))
        self.gone.set()

    async def echo(self, conn, msg_type, body, payload):
        return Reply(body, payload)

    async def note(self, conn, msg_type, body, payload):
        self.notes.append((conn.peer_id, body, payload))
        if len(self.notes) >= self.notes_wanted:
            self.note_count.set()
        return "ignored"

    async def slow(self, conn, msg_type, body, payload):
        self.slow_running += 1
        self.slow_started.set()
        await trio.sleep_forever()

    async def wait_slow(self, n: int) -> None:
        """Until n SLOW handlers have started."""
        with trio.fail_after(5):
            while self.slow_running < n:
                await self.slow_started.wait()
                self.slow_started = trio.Event()

    async def bad(self, conn, msg_type, body, payload):
        raise ProtocolError("bad body")

    async def crash(self, conn, msg_type, body, payload):
        raise RuntimeError("boom")

    async def fail(self, conn, msg_type, body, payload):
        raise RequestTimeout("a request of the handler's own timed out")

    async def huge(self, conn, msg_type, body, payload):
        return "x" * (CONFIG.max_control_frame_bytes + 1)

    async def late(self, conn, msg_type, body, payload):
        self.late_started.set()
        await self.release.wait()
        return "late"


@dataclass
class Peers:
    kind: str
    a: Side
    b: Side
    ab: PeerConnection  # a's connection to b
    ba: PeerConnection  # b's connection to a


@pytest.fixture(params=["tcp", "mem"])
def kind(request):
    return request.param


@pytest.fixture
def clock(kind):
    return trio.testing.MockClock(autojump_threshold=0) if kind == "mem" else None


async def start_pair(kind: str, nursery: trio.Nursery) -> tuple[PeerTransport, PeerTransport]:
    if kind == "tcp":
        a = Transport(Identity.generate(), KEY, CONFIG, region="eu")
        b = Transport(Identity.generate(), KEY, CONFIG, region="us")
        await nursery.start(a.serve, "127.0.0.1", 0)
        await nursery.start(b.serve, "127.0.0.1", 0)
        return a, b
    net = MemNetwork(uniform_link(0.005, 1e9), config=CONFIG)
    a, b = net.add(Identity.generate().peer_id, "eu"), net.add(Identity.generate().peer_id, "us")
    await nursery.start(net.run)
    await nursery.start(a.serve)
    await nursery.start(b.serve)
    return a, b


@pytest.fixture
async def peers(kind, nursery) -> Peers:
    ta, tb = await start_pair(kind, nursery)
    a, b = Side(ta), Side(tb)
    a.install()
    b.install()
    ab = await ta.connect(*tb.listen_address)
    with trio.fail_after(5):
        await b.arrived.wait()
    return Peers(kind, a, b, ab, b.connected[0])


async def wait_gone(*sides: Side) -> None:
    with trio.fail_after(5):
        for s in sides:
            await s.gone.wait()


# ---- the interface ---------------------------------------------------------------------------


def _methods(protocol) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(protocol).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


@pytest.mark.parametrize("impl, protocol", [(Transport, PeerTransport), (MemTransport, PeerTransport),
                                             (Connection, PeerConnection), (MemConnection, PeerConnection)])
def test_methods_match_the_interface(impl, protocol):
    for name, want in _methods(protocol).items():
        fn = getattr(impl, name)
        got = inspect.signature(fn)
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == \
               [(p.name, p.kind, p.default) for p in want.parameters.values()], f"{impl.__name__}.{name}"
        assert inspect.iscoroutinefunction(fn) == inspect.iscoroutinefunction(vars(protocol)[name]), name


async def test_both_ends_satisfy_the_interface(peers, clock):
    for side in (peers.a, peers.b):
        assert isinstance(side.t, PeerTransport)
    for conn in (peers.ab, peers.ba):
        assert isinstance(conn, PeerConnection)
        assert not conn.closed and conn.close_reason == ""
    assert peers.ab.peer_id == peers.b.t.peer_id and peers.ba.peer_id == peers.a.t.peer_id
    assert peers.ab.region == "us" and peers.ba.region == "eu"
    assert peers.ab.listen_address == peers.b.t.listen_address
    assert peers.ba.listen_address == peers.a.t.listen_address
    assert peers.a.t.connection(peers.b.t.peer_id) is peers.ab and peers.a.t.connections() == [peers.ab]
    assert peers.b.t.connection(peers.a.t.peer_id) is peers.ba
    assert await peers.a.t.connect(*peers.b.t.listen_address) is peers.ab  # reused
    assert [c.peer_id for c in peers.a.connected] == [peers.b.t.peer_id]


async def test_handler_registration_rules(peers, clock):
    for msg_type in (0, 1, 256, -1):  # 0 and 1 belong to the transport
        with pytest.raises(ValueError):
            peers.a.t.handle(msg_type, peers.a.echo)
    with pytest.raises(ValueError):
        peers.a.t.handle(ECHO, peers.a.echo)


async def add_peer(peers: Peers, nursery: trio.Nursery, region: str = "asia") -> Side:
    """A third transport of the same kind (on the same in-memory network)."""
    if peers.kind == "tcp":
        t = Transport(Identity.generate(), KEY, CONFIG, region=region)
        await nursery.start(t.serve, "127.0.0.1", 0)
    else:
        t = peers.a.t.net.add(Identity.generate().peer_id, region)
        await nursery.start(t.serve)
    side = Side(t)
    side.install()
    return side


async def test_connections_are_known_by_verified_peer_id_not_announced_address(peers, nursery, clock):
    a = peers.a.t
    c, mallory = await add_peer(peers, nursery), await add_peer(peers, nursery)
    mallory.t.listen_address = c.t.listen_address  # a swarm member announcing another's address
    await mallory.t.connect(*a.listen_address)
    with trio.fail_after(5):
        while a.connection(mallory.t.peer_id) is None:
            await trio.sleep(0.01)
    assert a.connection(mallory.t.peer_id).listen_address == c.t.listen_address
    ac = await a.connect(*c.t.listen_address)  # a dial to c's address reaches c, not mallory
    assert ac.peer_id == c.t.peer_id
    assert await a.connect(*c.t.listen_address) is ac
    assert await a.connect(*c.t.listen_address, peer_id=c.t.peer_id) is ac
    assert await a.connect(*peers.b.t.listen_address, peer_id=peers.b.t.peer_id) is peers.ab
    assert (await ac.request(ECHO, "c"))[0] == "c"


async def test_dial_that_reaches_another_peer_is_refused(peers, nursery, clock):
    a, c = peers.a, await add_peer(peers, nursery)
    expected = Identity.generate().peer_id
    with pytest.raises(HandshakeError) as e:
        await a.t.connect(*c.t.listen_address, peer_id=expected)
    assert f"is peer {short_id(c.t.peer_id)}, not the expected peer {short_id(expected)}" in str(e.value)
    assert a.t.connection(c.t.peer_id) is None and a.t.connection(expected) is None
    assert [conn.peer_id for conn in a.connected] == [peers.b.t.peer_id]  # no connect callback for it
    assert (await (await a.t.connect(*c.t.listen_address, peer_id=c.t.peer_id)).request(ECHO, 1))[0] == 1


# ---- messages ----------------------------------------------------------------------------------


async def test_request_reply_with_payloads(peers, clock):
    payload = bytes(range(256)) * 1000  # several chunks in the test profile
    body, got = await peers.ab.request(ECHO, {"k": [1, 2.5, "s", b"\x00"]}, payload=payload)
    assert body == {"k": [1, 2.5, "s", b"\x00"]}
    assert isinstance(got, memoryview) and not got.readonly and bytes(got) == payload
    assert await peers.ab.request(ECHO, None) == (None, None)
    floats = array.array("f", [1.0, 2.0, 3.0])  # a typed buffer travels as its bytes
    _, got = await peers.ba.request(ECHO, "f32", payload=memoryview(floats))
    assert bytes(got) == floats.tobytes()
    # payload bytes are counted on both ends, replies included; bodies are not
    both = len(payload) + len(floats.tobytes())  # each end sent one request and one reply
    for conn in (peers.ab, peers.ba):
        assert conn.payload_bytes_sent == conn.payload_bytes_received == both


async def test_one_way_messages_arrive_and_get_no_reply(peers, clock):
    peers.b.notes_wanted = 20
    for i in range(20):
        await peers.ab.send(NOTE, i, payload=bytes([i]) * 10 if i % 2 else None)
    with trio.fail_after(5):
        await peers.b.note_count.wait()
    assert sorted(body for _, body, _ in peers.b.notes) == list(range(20))
    for sender, body, payload in peers.b.notes:
        assert sender == peers.a.t.peer_id
        assert (payload is None) if body % 2 == 0 else bytes(payload) == bytes([body]) * 10
    assert (await peers.ab.request(ECHO, "after"))[0] == "after"


async def test_handler_failures_become_error_replies(peers, clock):
    with pytest.raises(RemoteError, match="unknown message type 77"):
        await peers.ab.request(77, {})
    with pytest.raises(RemoteError, match="internal error"):
        await peers.ab.request(CRASH, {})
    with pytest.raises(RemoteError, match="handler failed"):
        await peers.ab.request(FAIL, {})
    with pytest.raises(RemoteError, match="not encodable"):
        await peers.ab.request(HUGE, {})
    await peers.ab.send(CRASH, {})  # a one-way message whose handler crashes: nothing comes back
    assert (await peers.ab.request(ECHO, 1))[0] == 1  # still connected
    assert not peers.ab.closed and not peers.a.disconnected and not peers.b.disconnected
    # each refused message is counted by the receiving transport, by reason and type
    refused = peers.b.t.refusals
    assert refused.get(Refusals.UNKNOWN, 77) == 1 and refused.get(Refusals.FAILED, CRASH) == 2
    assert refused.to_wire() == {f"failed/{CRASH}": 2, "unknown/77": 1}
    assert peers.a.t.refusals.total() == 0


async def test_outgoing_limits_raise_value_error(peers, clock):
    with pytest.raises(ValueError):
        await peers.ab.send(NOTE, "x" * (CONFIG.max_control_frame_bytes + 1))
    with pytest.raises(ValueError):
        await peers.ab.send(256, {})
    with pytest.raises(ValueError):
        await peers.ab.request(ECHO, {}, payload=bytes(CONFIG.max_payload_bytes + 1))
    with pytest.raises(ValueError):
        await peers.ab.send(NOTE, object())
    assert (await peers.ab.request(ECHO, 2))[0] == 2


async def test_too_many_handlers_at_once_get_busy(peers, clock):
    async with trio.open_nursery() as n:
        for _ in range(CONFIG.max_concurrent_handlers):
            n.start_soon(_expect_closed_or_timeout, peers.ab.request(SLOW, {}, timeout_s=30))
        await peers.b.wait_slow(CONFIG.max_concurrent_handlers)
        with pytest.raises(RemoteError, match="busy"):
            await peers.ab.request(ECHO, 1)
        assert peers.b.t.refusals.get(Refusals.BUSY, ECHO) == 1
        await peers.ab.close("done")


async def _expect_closed_or_timeout(coro):
    with pytest.raises((ConnectionClosed, RequestTimeout)):
        await coro


# ---- timeouts and late replies ----------------------------------------------------------------


async def test_request_timeout(peers, clock):
    t0 = trio.current_time()
    with pytest.raises(RequestTimeout, match="no reply"):
        await peers.ab.request(SLOW, {}, timeout_s=0.3)
    t1 = trio.current_time()
    with pytest.raises(RequestTimeout):
        await peers.ab.request(SLOW, {})  # the transport's request_timeout_s
    t2 = trio.current_time()
    assert 0.3 <= t1 - t0 < 2.3 and CONFIG.request_timeout_s <= t2 - t1 < CONFIG.request_timeout_s + 2
    if peers.kind == "mem":
        assert (t1 - t0, t2 - t1) == (pytest.approx(0.3), pytest.approx(CONFIG.request_timeout_s))
    assert (await peers.ab.request(ECHO, 3))[0] == 3
    assert not peers.ab.closed


async def test_late_reply_is_dropped(peers, clock, caplog):
    caplog.set_level(logging.DEBUG, logger="dtfm.net")
    with pytest.raises(RequestTimeout):
        await peers.ab.request(LATE, {}, timeout_s=0.2)
    peers.b.release.set()  # b answers now; nobody waits for that reply any more
    assert (await peers.ab.request(ECHO, 4))[0] == 4  # same link, so the late reply came first
    assert any("late or unknown reply" in r.getMessage() and peers.ab.short_id in r.getMessage()
               for r in caplog.records)
    assert not peers.ab.closed


# ---- closing --------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["send", "request"])
async def test_handler_protocol_error_closes_the_connection(peers, clock, caplog, how):
    caplog.set_level(logging.DEBUG, logger="dtfm.net")
    async with trio.open_nursery() as n:
        n.start_soon(_expect_closed, peers.ab.request(SLOW, {}, timeout_s=30))  # waiting when it closes
        await peers.b.wait_slow(1)
        if how == "send":
            await peers.ab.send(BAD, {})
        else:
            with pytest.raises(ConnectionClosed, match="protocol error"):
                await peers.ab.request(BAD, {}, timeout_s=30)
        await wait_gone(peers.a, peers.b)
    reason = f"protocol error in message type {BAD}: bad body"
    assert peers.b.t.refusals.get(Refusals.MALFORMED, BAD) == 1
    assert peers.b.disconnected == [(peers.ba, reason)]
    assert peers.a.disconnected == [(peers.ab, f"closed by peer: {reason}")]
    assert peers.ab.closed and peers.ba.closed
    assert peers.a.t.connection(peers.b.t.peer_id) is None and peers.b.t.connections() == []
    assert any(r.levelno <= logging.INFO and peers.ba.short_id in r.getMessage() and "bad body" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ConnectionClosed):
        await peers.ab.send(NOTE, 1)
    with pytest.raises(ConnectionClosed):
        await peers.ab.request(ECHO, 1)
    again = await peers.a.t.connect(*peers.b.t.listen_address)  # a new connection works
    assert again is not peers.ab and (await again.request(ECHO, 5))[0] == 5


async def _expect_closed(coro):
    with pytest.raises(ConnectionClosed):
        await coro


async def test_close_fails_waiting_requests_on_both_ends(peers, clock):
    async with trio.open_nursery() as n:
        n.start_soon(_expect_closed, peers.ab.request(SLOW, {}, timeout_s=30))
        n.start_soon(_expect_closed, peers.ba.request(LATE, {}, timeout_s=30))
        await peers.b.wait_slow(1)
        with trio.fail_after(5):
            await peers.a.late_started.wait()
        await peers.ab.close("bye now")
        await wait_gone(peers.a, peers.b)
    assert peers.a.disconnected == [(peers.ab, "bye now")]
    assert peers.b.disconnected == [(peers.ba, "closed by peer: bye now")]
    with pytest.raises(ConnectionClosed):
        await peers.ba.send(NOTE, 1)


async def test_aclose_closes_every_connection(peers, clock):
    await peers.b.t.aclose()
    await wait_gone(peers.a, peers.b)
    assert peers.b.disconnected == [(peers.ba, "transport closing")]
    assert peers.a.disconnected == [(peers.ab, "closed by peer: transport closing")]
    with pytest.raises(ConnectionClosed):
        await peers.ab.request(ECHO, 1)
