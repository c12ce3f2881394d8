"""The daemon's discovery and lifecycle in one process, on an in-memory network under MockClock.

`FakeTransport` has the shape of dtfm.net.transport.Transport: listen, dial, handshake refusal
on a swarm key mismatch, request/one-way messages through the real msgpack codec, connect and
disconnect callbacks. Times below are virtual seconds.
"""

import dataclasses
import errno
import logging
import random
import tempfile
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.net import EmulatedLinks
from dtfm.net.addr import Address
from dtfm.net.errors import ConnectionClosed, HandshakeError, ProtocolError, RemoteError, RequestTimeout
from dtfm.net.dispatch import Refusals
from dtfm.net.identity import Identity
from dtfm.net.wire import pack, unpack_untrusted
from dtfm.peer.config import DaemonConfig, PeerConfig
from dtfm.peer.daemon import Daemon
from dtfm.peer.paths import DataDir
from dtfm.peer.peerbook import PeerBook, backoff_delay_s
from dtfm.peer.pex import PeerExchange, PeerRecord
from dtfm.peer.services import GossipPart
from dtfm.peer.control_client import ControlCommandError
from dtfm.scenarios import load_scenario

KEY = b"k" * 32


class FakeNet:
    """Listeners by (host, port); one listening on a wildcard is found at its machine's host.
    With `blackhole`, a dial to an address nobody listens on hangs instead of being refused."""

    def __init__(self):
        self.listeners: dict[tuple[str, int], "FakeTransport"] = {}
        self.next_port = 40000
        self.blackhole = False

    def port(self) -> int:
        self.next_port += 1
        return self.next_port


class FakeConnection:
    def __init__(self, local, remote, remote_address):
        self.local, self.remote = local, remote
        self.peer_id = remote.peer_id
        self.short_id = remote.peer_id[:4].hex()
        self.region = remote.region
        self.listen_address = remote.listen_address
        self.remote_address = remote_address
        self.last_seen = trio.current_time()
        self.closed = False
        self.payload_bytes_sent = self.payload_bytes_received = 0
        self.twin: "FakeConnection | None" = None

    async def _deliver(self, msg_type, body, payload):
        if self.closed:
            raise ConnectionClosed("closed")
        body = unpack_untrusted(pack(body), max_len=1 << 20)
        await trio.sleep(0.01)   # one-way latency
        self.twin.last_seen = trio.current_time()
        handler = self.remote.handlers.get(msg_type)
        if handler is None:
            raise RemoteError(f"{self.short_id}: unknown message type")
        try:
            return await handler(self.twin, msg_type, body, payload)
        except ProtocolError as e:
            await self.close(f"protocol error: {e}")
            raise ConnectionClosed(str(e)) from None
        except Exception:
            raise RemoteError(f"{self.short_id}: internal error") from None

    async def request(self, msg_type, body, *, payload=None, timeout_s=None):
        with trio.move_on_after(timeout_s or 30) as scope:
            reply = await self._deliver(msg_type, body, payload)
            await trio.sleep(0.01)
            self.last_seen = trio.current_time()
            return unpack_untrusted(pack(reply), max_len=1 << 20), None
        assert scope.cancelled_caught
        raise RequestTimeout("no reply")

    async def send(self, msg_type, body, *, payload=None, droppable=False):
        await self._deliver(msg_type, body, payload)

    async def close(self, reason=""):
        for conn, why in ((self, reason), (self.twin, reason or "closed by peer")):
            if not conn.closed:
                conn.closed = True
                conn.local.conns.pop(conn.peer_id, None)
                for cb in conn.local.disconnect_cbs:
                    cb(conn, why)


class FakeTransport:
    def __init__(self, net, identity, swarm_key, region="", host="127.0.0.9"):
        self.net, self.identity, self.swarm_key, self.region = net, identity, swarm_key, region
        self.host = host          # the machine's address: where its dials come from
        self.peer_id = identity.peer_id
        self.listen_address = ("", 0)
        self.handlers, self.conns = {}, {}
        self.connect_cbs, self.disconnect_cbs = [], []
        self.dials = 0
        self.inflight = self.max_inflight = 0
        self.unreachable = False  # a firewall drops every dial to this machine
        self.dead = False
        self._scope = None
        self.refusals = Refusals()

    def handle(self, msg_type, handler):
        self.handlers[msg_type] = handler

    def on_connect(self, cb):
        self.connect_cbs.append(cb)

    def on_disconnect(self, cb):
        self.disconnect_cbs.append(cb)

    def connection(self, peer_id):
        return self.conns.get(peer_id)

    def connections(self):
        return list(self.conns.values())

    async def serve(self, host, port, *, task_status=trio.TASK_STATUS_IGNORED):
        port = port or self.net.port()
        key = (self.host if host in ("0.0.0.0", "::") else host, port)
        if key in self.net.listeners:
            raise OSError(errno.EADDRINUSE, "Address already in use")
        self.listen_address = (host, port)
        self.net.listeners[key] = self
        try:
            with trio.CancelScope() as self._scope:
                task_status.started((host, port))
                await trio.sleep_forever()
        finally:
            del self.net.listeners[key]

    async def connect(self, host, port):
        self.dials += 1
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            return await self._connect(host, port)
        finally:
            self.inflight -= 1

    async def _connect(self, host, port):
        await trio.sleep(0.02)
        other = self.net.listeners.get((host, port))
        if (other is None or other.unreachable) and self.net.blackhole:
            await trio.sleep_forever()
        if other is None or other.dead or self.dead or other.unreachable:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        if other.swarm_key != self.swarm_key:
            logging.getLogger("fake.transport").warning(
                "refused handshake from %s: wrong swarm key", self.identity.short_id)
            raise HandshakeError("the peer refused the handshake: wrong swarm key")
        if other.peer_id in self.conns:
            return self.conns[other.peer_id]
        mine = FakeConnection(self, other, (host, port))
        theirs = FakeConnection(other, self, (self.host, self.net.port()))
        mine.twin, theirs.twin = theirs, mine
        self.conns[other.peer_id] = mine
        other.conns[self.peer_id] = theirs
        for cb in other.connect_cbs:
            cb(theirs)
        for cb in self.connect_cbs:
            cb(mine)
        return mine

    async def aclose(self):
        for conn in list(self.conns.values()):
            await conn.close("transport closing")
        if self._scope is not None:
            self._scope.cancel()

    def crash(self):
        """Vanish without a goodbye: connections drop, nothing listens or dials any more."""
        self.dead = True
        for conn in list(self.conns.values()):
            conn.twin.closed = conn.closed = True
        for conn in list(self.conns.values()):
            self.conns.pop(conn.peer_id)
            conn.remote.conns.pop(self.peer_id, None)
            for cb in conn.remote.disconnect_cbs:
                cb(conn.twin, "connection reset")
        self._scope.cancel()


@pytest.fixture
def autojump():
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture
def short_tmp():
    with tempfile.TemporaryDirectory(prefix="dtfm-d-", dir="/tmp") as d:
        yield Path(d)


class Swarm:
    def __init__(self, nursery, root):
        self.nursery, self.root = nursery, root
        self.net = FakeNet()
        self.rng = random.Random(7)

    async def start(self, name, *, bootstrap=(), key=KEY, port=0, region="", services=(),
                    listen="127.0.0.1", host="127.0.0.9", advertise=None, discovery=None):
        config = DaemonConfig.test()
        config = DaemonConfig(
            peer=PeerConfig(listen=Address(listen, port), bootstrap=tuple(bootstrap),
                            region=region, advertise=advertise),
            discovery=discovery or config.discovery, socket=config.socket)
        ident = Identity(bytes([len(name)]) + name.encode().ljust(31, b"."))
        transport = FakeTransport(self.net, ident, key, region, host=host)
        data_dir = DataDir(self.root / name)
        data_dir.ensure()
        daemon = Daemon(config, ident, transport, data_dir, rng=random.Random(self.rng.random()))
        for svc in services:
            daemon.add_service(svc)
        daemon.done = trio.Event()

        async def run(task_status=trio.TASK_STATUS_IGNORED):
            try:
                await daemon.run(task_status=task_status)
            finally:
                daemon.done.set()

        await self.nursery.start(run)
        return daemon


async def wait_until(condition, within_s=5.0):
    """Poll `condition` every 10 virtual ms; fail after `within_s` virtual seconds."""
    with trio.fail_after(within_s):
        while not condition():
            await trio.sleep(0.01)


def seen(daemon):
    return sorted(p["short_id"] for p in daemon.status()["peers"])


def ids(*daemons):
    return sorted(d.short_id for d in daemons)


async def test_three_daemons_find_each_other_through_one_bootstrap(autojump, short_tmp):
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, short_tmp)
        a = await swarm.start("a", region="eu")
        b = await swarm.start("b", bootstrap=[a.listen_address])
        c = await swarm.start("c", bootstrap=[a.listen_address])
        t0 = trio.current_time()
        await wait_until(lambda: seen(a) == ids(b, c) and seen(b) == ids(a, c)
                         and seen(c) == ids(a, b))
        # b learns of c (and c of b) in the first exchange after c joins a: well under 1 s.
        assert trio.current_time() - t0 < 1.0
        status = c.status()
        entry = next(p for p in status["peers"] if p["short_id"] == a.short_id)
        assert entry["address"] == str(a.listen_address)
        assert entry["region"] == "eu"
        assert entry["peer_id"] == a.peer_id.hex()
        assert status["listen"] == str(c.listen_address)
        assert status["uptime_s"] == pytest.approx(trio.current_time() - c.started_at)
        assert status["departed"] == []
        assert set(status["loop"]) == {"late_ms_worst_1m", "late_ms_worst", "stalls", "stall_ms", "last_stall"}
        nursery.cancel_scope.cancel()


async def test_leave_tells_peers_and_run_returns(autojump, short_tmp):
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, short_tmp)
        a = await swarm.start("a")
        b = await swarm.start("b", bootstrap=[a.listen_address])
        c = await swarm.start("c", bootstrap=[a.listen_address])
        await wait_until(lambda: len(seen(b)) == 2 and len(seen(c)) == 2)
        b.request_leave("maintenance")
        with trio.fail_after(5):
            await b.done.wait()
        for d in (a, c):
            st = d.status()
            assert b.short_id not in seen(d)
            assert [(x["short_id"], x["reason"]) for x in st["departed"]] == [
                (b.short_id, "maintenance")]
        # Nobody redials a peer that said goodbye, and the remaining two stay connected.
        dials = a.transport.dials + c.transport.dials
        await trio.sleep(10)
        assert a.transport.dials + c.transport.dials == dials
        assert seen(a) == [c.short_id] and seen(c) == [a.short_id]
        assert not b.transport.conns
        nursery.cancel_scope.cancel()


async def test_leave_hooks_run_in_order_before_the_goodbye_while_connections_are_up(autojump, short_tmp, caplog):
    # (the control plane's hand-off and gossip's LEFT claim need the transport: peer/services.py)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, short_tmp)
        a = await swarm.start("a")
        b = await swarm.start("b", bootstrap=[a.listen_address])
        await wait_until(lambda: seen(a) == [b.short_id] and seen(b) == [a.short_id])
        ran: list[tuple[str, bool, list]] = []

        async def broken():
            ran.append(("broken", bool(b.transport.conns), seen(a)))
            raise RuntimeError("boom")

        async def hand_off():
            await trio.sleep(1.0)  # a hand-off takes a while: nobody is told meanwhile
            ran.append(("hand-off", bool(b.transport.conns), seen(a)))

        b.add_leave_hook(broken, name="broken")
        b.add_leave_hook(hand_off, name="hand-off")
        with caplog.at_level(logging.WARNING, logger="dtfm.peer.daemon"):
            b.request_leave("maintenance")
            with trio.fail_after(5):
                await b.done.wait()
        assert ran == [("broken", True, [b.short_id]), ("hand-off", True, [b.short_id])]
        assert "leave hook broken failed: RuntimeError: boom" in caplog.text
        assert [x["reason"] for x in a.status()["departed"]] == ["maintenance"]
        nursery.cancel_scope.cancel()


async def test_bootstrap_is_retried_with_backoff_until_it_appears(autojump, short_tmp):
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, short_tmp)
        b = await swarm.start("b", bootstrap=[Address("127.0.0.1", 7450)])
        await trio.sleep(3.0)
        # Backoff from 0.05 s doubling to 0.5 s: about a dozen tries in 3 s, not hundreds.
        assert 4 <= b.transport.dials <= 20
        a = await swarm.start("a", port=7450)
        with trio.fail_after(1.0):   # the next retry comes within retry_max_s
            while seen(b) != [a.short_id]:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


async def test_wrong_swarm_key_is_refused_with_clear_messages(autojump, short_tmp, caplog):
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, short_tmp)
        a = await swarm.start("a")
        intruder = await swarm.start("x", bootstrap=[a.listen_address], key=b"z" * 32)
        await trio.sleep(2.0)
        assert seen(a) == [] and seen(intruder) == []
        errors = [r for r in caplog.records if r.name == "dtfm.peer.discovery"
                  and r.levelno == logging.ERROR]
        assert errors
        assert all("refused the handshake" in r.getMessage() and "wrong swarm key"
                   in r.getMessage() for r in errors)
        assert any("wrong swarm key" in r.getMessage() for r in caplog.records
                   if r.name == "fake.transport")
        nursery.cancel_scope.cancel()


async def test_crashed_peer_is_redialled_then_forgotten(autojump, short_tmp):
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, short_tmp)
        a = await swarm.start("a")
        b = await swarm.start("b", bootstrap=[a.listen_address])
        c = await swarm.start("c", bootstrap=[a.listen_address])
        await wait_until(lambda: len(seen(b)) == 2 and len(seen(c)) == 2)
        c.transport.crash()
        assert seen(a) == [b.short_id]
        assert c.peer_id in a.discovery.book.entries   # kept for redialling
        await trio.sleep(60)
        assert c.peer_id not in a.discovery.book.entries and c.peer_id not in b.discovery.book.entries
        assert a.status()["departed"] == []   # a crash is not a goodbye
        nursery.cancel_scope.cancel()


async def test_services_and_status_providers(autojump, short_tmp):
    events = []

    async def service(daemon, *, task_status=trio.TASK_STATUS_IGNORED):
        # Started after the transport listens: the listen address is known.
        events.append(("started", str(daemon.listen_address)))
        daemon.add_status_provider("role", lambda: {"stage": 2, "step": len(events)})
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            events.append(("stopped",))

    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, short_tmp)
        a = await swarm.start("a", services=[service])
        a.add_status_provider("broken", lambda: 1 / 0)
        a.add_status_provider("unpackable", lambda: object())
        with pytest.raises(ValueError):
            a.add_status_provider("peers", lambda: 1)
        with pytest.raises(ValueError):
            a.add_status_provider("role", lambda: 1)
        with pytest.raises(RuntimeError):
            a.add_service(service)
        st = a.status()
        assert st["role"] == {"stage": 2, "step": 1}
        assert "ZeroDivisionError" in st["broken"]["error"]
        assert "error" in st["unpackable"]
        pack(st)
        a.request_leave()
        await a.done.wait()
        assert events == [("started", str(a.listen_address)), ("stopped",)]


async def test_bad_peer_exchange_body_closes_only_that_connection(autojump, short_tmp):
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, short_tmp)
        a = await swarm.start("a")
        b = await swarm.start("b", bootstrap=[a.listen_address])
        await wait_until(lambda: seen(b))
        conn = b.transport.connection(a.peer_id)
        for body in [{"peers": [{"id": b"short", "host": "h", "port": 1, "region": ""}]},
                     {"peers": [{"id": b"i" * 32, "host": "0.0.0.0", "port": 1, "region": ""}]},
                     {"peers": "nope"}, [1, 2]]:
            with pytest.raises(ProtocolError):
                await a.discovery._on_peer_exchange(conn.twin, 16, body, None)
        assert a.status()["peers"]   # handler errors alone do not disturb the daemon
        nursery.cancel_scope.cancel()


def test_backoff_doubles_up_to_the_cap_with_jitter():
    rng = random.Random(1)
    delays = [backoff_delay_s(n, 0.5, 30.0, rng) for n in range(1, 10)]
    caps = [min(30.0, 0.5 * 2 ** (n - 1)) for n in range(1, 10)]
    assert all(c / 2 <= d < c for d, c in zip(delays, caps))
    assert backoff_delay_s(0, 0.5, 30.0, rng) == 0.0
    assert backoff_delay_s(10_000, 0.5, 30.0, rng) < 30.0


@pytest.mark.parametrize("steps,expected", [
    # (event, peer, now) ... -> peers due at the end
    ([("learn", 1, 0.0)], [1]),
    ([("learn", 1, 0.0), ("due", None, 0.0)], []),                       # already dialling
    ([("learn", 1, 0.0), ("due", None, 0.0), ("fail", 1, 0.0)], []),    # backing off
    ([("learn", 1, 0.0), ("due", None, 0.0), ("fail", 1, 0.0), ("at", None, 1.0)], [1]),
    ([("connect", 1, 0.0), ("drop", 1, 0.0), ("at", None, 1.0)], [1]),  # redial after a drop
    ([("connect", 1, 0.0), ("left", 1, 0.0), ("learn", 1, 1.0)], []),   # goodbye: not redialled
    ([("connect", 1, 0.0), ("left", 1, 0.0), ("connect", 1, 1.0), ("drop", 1, 1.0),
      ("at", None, 9.0)], [1]),                                          # came back, dropped
    ([("learn", 0, 0.0)], []),                                           # ourselves
])
def test_peer_book_decisions(steps, expected):
    book = PeerBook(bytes([0]) * 32, retry_initial_s=0.5, retry_max_s=1.0,
                    rng=random.Random(3))
    pid = lambda n: bytes([n]) * 32   # noqa: E731
    addr = Address("10.0.0.1", 7450)
    now = 0.0
    for event, n, t in steps:
        now = t
        if event == "learn":
            book.learn(pid(n), addr, "", t)
        elif event == "due":
            book.due(t)
        elif event == "fail":
            book.dial_failed(pid(n), t)
        elif event == "connect":
            book.connected(pid(n), addr, "", t)
        elif event == "drop":
            book.disconnected(pid(n), t)
        elif event == "left":
            book.left(pid(n), t, "bye")
    assert sorted(p[0] for p, _ in book.due(now)) == expected


def test_peer_book_forgets_after_repeated_failures():
    book = PeerBook(b"\0" * 32, retry_initial_s=0.1, retry_max_s=0.1, forget_after_failures=3,
                    rng=random.Random(0))
    p = b"\1" * 32
    book.learn(p, Address("h", 1), "", 0.0)
    assert [book.dial_failed(p, 0.0) for _ in range(3)] == [False, False, True]
    assert p not in book.entries
    assert book.learn(p, Address("h", 1), "", 1.0)   # a fresh mention starts over


def test_departed_list_is_bounded():
    book = PeerBook(b"\0" * 32, retry_initial_s=0.1, retry_max_s=0.1, departed_keep=2)
    for n in range(1, 5):
        book.connected(bytes([n]) * 32, Address("h", n), "", 0.0)
        book.left(bytes([n]) * 32, float(n), "bye")
    assert [d.peer_id[0] for d in book.departed.values()] == [3, 4]


async def test_own_address_in_the_bootstrap_list_is_skipped(autojump, short_tmp):
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, short_tmp)
        a = await swarm.start("a", port=7450, bootstrap=[Address("127.0.0.1", 7450)])
        b = await swarm.start("b", port=7451, bootstrap=[Address("127.0.0.1", 7450),
                                                         Address("127.0.0.1", 7451)])
        await wait_until(lambda: seen(a) == [b.short_id] and seen(b) == [a.short_id])
        await trio.sleep(5)
        assert a.transport.dials == 0
        assert b.transport.dials == 1
        nursery.cancel_scope.cancel()


wire_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=20)
record = st.fixed_dictionaries({"id": st.binary(min_size=30, max_size=33),
                                "host": st.sampled_from(["10.0.0.1", "0.0.0.0", "", "h h", "x"]),
                                "port": st.integers(-1, 70000),
                                "region": st.text(max_size=70)})


@settings(max_examples=200, deadline=None)
@given(st.one_of(wire_values, st.fixed_dictionaries({"peers": st.lists(record, max_size=3)}),
                 st.fixed_dictionaries({"peers": st.lists(wire_values, max_size=3)})))
def test_peer_exchange_from_wire_raises_only_protocol_error(body):
    try:
        msg = PeerExchange.from_wire(unpack_untrusted(pack(body), max_len=1 << 20))
    except ProtocolError:
        return
    for rec in msg.peers:
        assert len(rec.peer_id) == 32 and 1 <= rec.address.port <= 65535
        assert not rec.address.is_unspecified
        assert PeerRecord.from_wire(rec.to_wire()) == rec


async def test_a_failing_service_stops_the_daemon(autojump, short_tmp):
    async def faulty(daemon, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        await trio.sleep(1.0)
        raise RuntimeError("stage 3 lost its weights")

    with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="lost its weights"),
                            flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            swarm = Swarm(nursery, short_tmp)
            a = await swarm.start("a", services=[faulty])
            await a.done.wait()
    assert not (short_tmp / "a" / "control" / "peer.sock").exists()


async def test_peer_whose_exchange_handler_fails_stays_connected(autojump, short_tmp):
    async def broken(conn, msg_type, body, payload):
        raise RuntimeError("bug in an older peer")

    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, short_tmp)
        a = await swarm.start("a")
        a.transport.handlers[16] = broken   # every exchange a answers is an error reply
        b = await swarm.start("b", bootstrap=[a.listen_address])
        await wait_until(lambda: seen(b) == [a.short_id])
        await trio.sleep(5)   # several periodic exchanges fail; b keeps running
        assert seen(b) == [a.short_id]
        assert not b.done.is_set()
        nursery.cancel_scope.cancel()


# ---- the advertised address ------------------------------------------------------------------

from dtfm.peer.advertise import Advertiser
from dtfm.peer.pex import AddressSeen
from dtfm.peer.ratelimit import SourceRate

HOSTS = ("10.77.0.1", "10.77.0.2", "10.77.0.3")


async def test_peers_on_a_wildcard_advertise_the_address_their_peers_confirm(autojump, short_tmp):
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, short_tmp)
        a = await swarm.start("a", listen="0.0.0.0", port=7450, host=HOSTS[0])
        assert a.status()["advertise"] is None   # nothing dialable until a peer confirms
        assert a.transport.listen_address == ("0.0.0.0", 7450)
        first = Address(HOSTS[0], 7450)
        b = await swarm.start("b", listen="0.0.0.0", port=7450, host=HOSTS[1], bootstrap=[first])
        c = await swarm.start("c", listen="0.0.0.0", port=7450, host=HOSTS[2], bootstrap=[first])
        daemons = (a, b, c)
        await wait_until(lambda: all(len(seen(d)) == 2 for d in daemons)
                         and all(d.discovery.advertised is not None for d in daemons))
        for d, host in zip(daemons, HOSTS):
            assert d.status()["advertise"] == f"{host}:7450"
            assert d.transport.listen_address == (host, 7450)   # the handshake carries it too
            for p in d.status()["peers"]:
                assert p["address"].startswith("10.77.0.") and p["address"].endswith(":7450")
        nursery.cancel_scope.cancel()


async def test_an_address_the_asked_peer_cannot_dial_back_is_not_adopted(autojump, short_tmp):
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, short_tmp)
        a = await swarm.start("a", listen="0.0.0.0", port=7450, host=HOSTS[0])
        b = await swarm.start("b", listen="0.0.0.0", port=7450, host=HOSTS[1],
                              bootstrap=[Address(HOSTS[0], 7450)])
        b.transport.unreachable = True      # b dials out, nobody can dial in
        await wait_until(lambda: a.discovery.advertised is not None, within_s=10)
        await trio.sleep(5.0)
        assert a.discovery.advertised == Address(HOSTS[0], 7450)
        assert b.discovery.advertised is None
        assert b.status()["advertise"] is None
        nursery.cancel_scope.cancel()


async def test_advertise_option_is_used_as_given(autojump, short_tmp):
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, short_tmp)
        a = await swarm.start("a", listen="0.0.0.0", port=7450, host=HOSTS[0],
                              advertise=Address("203.0.113.5", 0))
        assert a.discovery.advertised == Address("203.0.113.5", 7450)
        assert a.transport.listen_address == ("203.0.113.5", 7450)
        nursery.cancel_scope.cancel()


PID = b"p" * 32


@pytest.mark.parametrize("listen, configured, bootstrap, initial", [
    ("0.0.0.0:7450", None, (), None),
    ("0.0.0.0:7450", None, ("10.0.0.1:7450",), None),
    ("0.0.0.0:7450", None, ("127.0.0.1:7450", "localhost:7451"), "127.0.0.1:7450"),
    ("[::]:7450", None, ("[::1]:7450",), "[::1]:7450"),
    ("0.0.0.0:7450", "198.51.100.7:9000", (), "198.51.100.7:9000"),
    ("10.0.0.2:7450", None, ("10.0.0.1:7450",), "10.0.0.2:7450"),
    ("127.0.0.1:7450", None, (), "127.0.0.1:7450"),
])
def test_advertiser_initial_address(listen, configured, bootstrap, initial):
    adv = Advertiser(Address.parse(listen), configured and Address.parse(configured),
                     tuple(Address.parse(b) for b in bootstrap))
    assert adv.address == (initial and Address.parse(initial))
    assert adv.needs_confirmation == (initial is None)


@pytest.mark.parametrize("bootstrap, seen, confirmed, adopted", [
    (("10.0.0.1:7450",), "10.0.0.2:7450", True, True),
    (("10.0.0.1:7450",), "10.0.0.2:7450", False, False),    # the dial back failed
    (("10.0.0.1:7450",), "10.0.0.2:7451", True, False),     # not our port
    (("10.0.0.1:7450",), "127.0.0.1:7450", True, False),    # loopback, peers elsewhere
    ((), "127.0.0.1:7450", True, False),
    (("10.0.0.1:7450",), "0.0.0.0:7450", True, False),
])
def test_advertiser_adopts_only_a_confirmed_routable_address(bootstrap, seen, confirmed, adopted):
    adv = Advertiser(Address("0.0.0.0", 7450), None, tuple(Address.parse(b) for b in bootstrap))
    address, why = adv.observed(AddressSeen(Address.parse(seen), confirmed), PID)
    assert (address is not None) == adopted, why
    assert adv.address == (Address.parse(seen) if adopted else None)
    if adopted:   # the first confirmed address stays
        again, _ = adv.observed(AddressSeen(Address("10.0.0.9", 7450), True), PID)
        assert again is None and adv.address == Address.parse(seen)


# ---- bounds against members that flood --------------------------------------------------------

def test_source_rate_is_a_token_bucket_per_source():
    rate = SourceRate(2.0, 3, max_sources=2)
    assert [rate.allow(b"a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert rate.allow(b"b", 0.0)              # another source has its own bucket
    assert not rate.allow(b"a", 0.4)          # 0.8 of a token
    assert rate.allow(b"a", 0.5)              # 1.0: one more
    assert not rate.allow(b"a", 0.5)
    assert [rate.allow(b"a", 100.0) for _ in range(4)] == [True, True, True, False]  # capped
    rate.allow(b"c", 100.0)
    assert len(rate) == 2                     # sources are bounded too


def _pid(i: int) -> bytes:
    return i.to_bytes(4, "big") + b"." * 28


def test_peer_book_bounds_total_and_per_source_evicting_the_oldest_unverified():
    book = PeerBook(b"self" + b"." * 28, retry_initial_s=1, retry_max_s=8, max_entries=4,
                    max_per_source=2, rng=random.Random(1))
    s1, s2, s3 = b"1" * 32, b"2" * 32, b"3" * 32
    addr = Address("10.0.0.1", 7450)
    assert book.learn(_pid(1), addr, "", 0.0, source=s1)
    assert book.learn(_pid(2), addr, "", 1.0, source=s1)
    assert book.learn(_pid(3), addr, "", 2.0, source=s1)      # s1 over its share: its oldest goes
    assert list(book.entries) == [_pid(2), _pid(3)]
    assert book.unverified_from(s1) == 2
    book.connected(_pid(9), addr, "", 3.0)                      # a connected peer is verified
    assert book.learn(_pid(4), addr, "", 4.0, source=s2)
    assert len(book.entries) == 4
    assert book.due(5.0, limit=1) == [(_pid(2), addr)]          # _pid(2) is being dialled now
    assert book.learn(_pid(5), addr, "", 6.0, source=s3)        # full: oldest unverified idle goes
    assert list(book.entries) == [_pid(2), _pid(9), _pid(4), _pid(5)]
    book.connected(_pid(2), addr, "", 7.0)                      # verified: no longer s1's
    assert book.unverified_from(s1) == 0
    assert book.learn(_pid(6), addr, "", 8.0, source=s3)        # evicts _pid(4)
    assert book.learn(_pid(7), addr, "", 9.0, source=s2)        # evicts _pid(5)
    assert book.due(10.0, limit=5) and book.dialling_count() == 2
    assert not book.learn(_pid(8), addr, "", 11.0, source=s3)   # nothing may go: refused
    assert set(book.entries) == {_pid(2), _pid(9), _pid(6), _pid(7)}


def test_peer_book_due_hands_out_at_most_the_limit_longest_waiting_first():
    book = PeerBook(b"self" + b"." * 28, retry_initial_s=1, retry_max_s=8, rng=random.Random(1))
    for i in range(5):
        book.learn(_pid(i), Address("10.0.0.1", 7000 + i), "", 4.0 - i)
    assert [p for p, _ in book.due(10.0, limit=2)] == [_pid(4), _pid(3)]
    assert [p for p, _ in book.due(10.0, limit=0)] == []
    assert [p for p, _ in book.due(10.0)] == [_pid(0), _pid(1), _pid(2)]


async def test_flooding_member_cannot_grow_the_book_nor_the_dials(autojump, short_tmp, caplog):
    bounds = dataclasses.replace(DaemonConfig.test().discovery, max_known_peers=64,
                                 max_peers_per_source=16, max_concurrent_dials=4,
                                 exchange_rate_per_s=1.0, exchange_burst=2)
    rng = random.Random(3)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, short_tmp)
        swarm.net.blackhole = True           # attacker-chosen addresses hang until the timeout
        a = await swarm.start("victim", discovery=bounds)
        evil = FakeTransport(swarm.net, Identity(b"e" * 32), KEY)
        await nursery.start(evil.serve, "127.0.0.1", 0)
        conn = await evil.connect(a.listen_address.host, a.listen_address.port)
        caplog.set_level(logging.DEBUG, logger="dtfm.peer.discovery")
        t0 = trio.current_time()
        sent = 0
        for _ in range(2000):                # 128,000 addresses at 50 lists per second
            records = [PeerRecord(rng.randbytes(32), Address(f"198.18.{rng.randrange(256)}.1",
                                                             rng.randrange(1, 65536)), "")
                       for _ in range(64)]
            await conn.request(16, PeerExchange(tuple(records)).to_wire())
            sent += 1
            book = a.discovery.book
            assert len(book.entries) <= bounds.max_known_peers
            assert book.unverified_from(evil.peer_id) <= bounds.max_peers_per_source
            assert a.transport.inflight <= bounds.max_concurrent_dials
        elapsed = trio.current_time() - t0
        assert a.transport.max_inflight == bounds.max_concurrent_dials   # bounded, and used
        ignored = sum("over its rate" in r.getMessage() for r in caplog.records)
        accepted = sent - ignored
        assert accepted <= bounds.exchange_burst + bounds.exchange_rate_per_s * elapsed + 2
        assert conn.closed is False          # flooding within the limits is not an error
        nursery.cancel_scope.cancel()


async def test_gossip_member_address_learnt_after_start_reaches_every_member(autojump):
    from dtfm.gossip.config import GossipConfig
    from dtfm.gossip.harness import Harness

    async with trio.open_nursery() as nursery:
        h = Harness(3, GossipConfig.test(), seed=1, measure=False)
        await h.start(nursery)
        await wait_until(h.all_know_all, within_s=30)
        svc = h.services[0]
        before = svc.swim.me.incarnation
        svc.set_address("10.77.0.1", 7450)
        assert svc.swim.me.address == ("10.77.0.1", 7450)
        assert svc.swim.me.incarnation == before + 1

        def everyone_sees_it():
            return all(m.address == ("10.77.0.1", 7450)
                       for s in h.services for m in s.members() if m.peer_id == svc.identity.peer_id)

        await wait_until(everyone_sees_it, within_s=30)
        nursery.cancel_scope.cancel()


async def test_the_emulate_op_jumps_this_peers_wall_clock_and_checks_the_jump():
    # A test swarm's clock jump (bench/soak.py): the times gossip signs move by the jump, back
    # at 0; anything but a bounded number of seconds is refused.
    config = DaemonConfig()
    config = dataclasses.replace(config, gossip=dataclasses.replace(config.gossip, codec_speed="reference"))
    scenario = load_scenario("worldwide")
    part = GossipPart(config, EmulatedLinks(scenario, scenario.regions[0].name))
    assert (await part.emulate({"clock_jump_s": -600}))["clock_jump_s"] == -600.0
    assert part.clock_jump_s == -600.0
    for bad in ("soon", True, 1e12, float("nan")):
        with pytest.raises(ControlCommandError, match="clock_jump_s"):
            await part.emulate({"clock_jump_s": bad})
    assert (await part.emulate({"clock_jump_s": 0}))["clock_jump_s"] == 0.0
