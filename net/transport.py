"""The peer transport: TCP over trio, handshake, admission control, connection registry.

    transport = Transport(identity, swarm_key, TransportConfig.default(), region="eu")
    transport.handle(MY_MSG, handler)
    host, port = await nursery.start(transport.serve, "0.0.0.0", 7000)
    conn = await transport.connect("10.0.0.2", 7000)
    reply, payload = await conn.request(MY_MSG, {"x": 1})

Every connection runs in the transport's nursery (the one `serve()` or `run()` opens), so
`connect()` needs one of them running. Between two peers at most one connection survives: when
both dial each other at once, both sides keep the one dialled by the smaller peer id; a newer
connection from the same dialler replaces an older one.

Connections are known by the peer id their handshake verified, never by the listen address a
peer announces (any swarm member can announce any address). `connect(host, port,
peer_id=...)` reuses only a live connection to that id, and refuses a fresh one whose
handshake proves another id; without `peer_id` it reuses a connection whose handshake over a
dial to that very host:port proved the peer's id.

Accepting: a connection first waits for its hello as a pending connection (bounded in count
overall and per source, `hello_timeout_s`); the hello then needs a handshake slot and a token
from its source's bucket (`ratelimit.HandshakeAdmission`) before the responder spends anything
on it. Refusals tell the other side only "handshake refused"; the reason goes to the DEBUG log
with the remote address.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import trio

from .budget import PayloadBudget
from .config import TransportConfig
from .connection import Connection
from .dispatch import Registry
from .errors import ConnectionClosed, HandshakeError, ProtocolError
from .handshake import (
    MAX_HANDSHAKE_BYTES,
    REFUSAL,
    HandshakeResult,
    Initiator,
    PeerHello,
    Responder,
    reject_message,
)
from .identity import Identity, short_id
from .lograte import LogLimiter
from .ratelimit import HandshakeAdmission, source_key
from .replay import HelloGuard
from .session import encode_prefix
from .shaping import LinkShaper
from .streamio import StreamReader

__all__ = ["Transport"]

logger = logging.getLogger(__name__)

MAX_DIALLED_ADDRESSES = 4096  # host:port -> verified peer id, remembered for reuse
# Refused handshakes are logged at WARNING at most once a minute per source host (ten lines a
# minute in all), with the count of those left out.
REFUSAL_LOG_INTERVAL_S = 60.0
REFUSAL_LOG_BURST = 10


class Transport(Registry[Connection]):
    """The TCP implementation of `PeerTransport`."""

    def __init__(
        self,
        identity: Identity,
        swarm_key: bytes,
        config: TransportConfig,
        *,
        region: str = "",
        shaper: LinkShaper | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if len(swarm_key) != 32:
            raise ValueError("the swarm key is 32 bytes")
        super().__init__()
        self.identity = identity
        self.peer_id = identity.peer_id
        self.region = region
        self.config = config
        self.listen_address: tuple[str, int] = ("", 0)
        self._swarm_key = bytes(swarm_key)
        self._suites = None if config.cipher_suites is None else list(config.cipher_suites)
        self._shaper = shaper
        self._all: set[Connection] = set()
        self._refusal_log = LogLimiter(REFUSAL_LOG_INTERVAL_S, burst=REFUSAL_LOG_BURST)
        self._admission = HandshakeAdmission(
            config.handshake_rate_per_s,
            config.handshake_burst,
            config.max_half_open_handshakes,
            max_half_open_per_host=config.max_half_open_per_host,
            max_pending=config.max_pending_connections,
            max_pending_per_host=config.max_pending_per_host,
        )
        # Wall-clock time (seconds since the epoch) for hello timestamps; injectable for tests.
        self._wall_clock = wall_clock
        self._hello_guard = HelloGuard(config.handshake_clock_skew_s)
        self._payload_budget = PayloadBudget(config.max_total_payload_bytes)
        self._dialled_ids: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._dialling: dict[tuple[str, int], trio.Event] = {}  # dials under way, by address
        self._nursery: trio.Nursery | None = None
        self._closed = False

    # ---- running -----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host connections without listening (dial-only peers, in-memory tests)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def serve(self, host: str, port: int, *,
                    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on host:port until cancelled; `task_status.started((host, bound_port))`."""
        listeners = await trio.open_tcp_listeners(port, host=host or None)
        bound_port = listeners[0].socket.getsockname()[1]
        if self.listen_address == ("", 0):
            self.listen_address = (host, bound_port)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(trio.serve_listeners, self._serve_tcp, listeners)
            logger.debug("transport %s listening on %s:%d", self.identity.short_id, host, bound_port)
            task_status.started((host, bound_port))
            await trio.sleep_forever()

    async def aclose(self) -> None:
        """Close every connection (telling the peers) and stop serving."""
        self._closed = True
        async with trio.open_nursery() as nursery:
            for conn in list(self._all):
                nursery.start_soon(conn.close, "transport closing")
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # ---- dialling ----------------------------------------------------------------------

    async def connect(self, host: str, port: int, *, peer_id: bytes | None = None) -> Connection:
        """A connection to the peer listening at host:port, reusing a live one.

        With `peer_id`, only a connection to that verified id is reused, and a fresh dial whose
        handshake proves another id is closed with a `HandshakeError` naming both."""
        while True:
            conn = self._reusable(host, port, peer_id)
            if conn is not None:
                return conn
            # One dial per address at a time: a second one from this side would replace the
            # first connection as a duplicate and cut the requests in flight on it. A task that
            # finds a dial under way takes its connection, or dials itself once that one failed
            # (within its handshake timeout).
            pending = self._dialling.get((host, port))
            if pending is None:
                break
            await pending.wait()
        if self._closed:
            raise ConnectionClosed("transport closed")
        if self._nursery is None:
            raise RuntimeError("Transport.serve() or Transport.run() must be running to connect")
        done = self._dialling[(host, port)] = trio.Event()
        try:
            try:
                with trio.fail_after(self.config.handshake_timeout_s):
                    stream = await trio.open_tcp_stream(host, port)
            except trio.TooSlowError:
                raise TimeoutError(f"connecting to {host}:{port} timed out") from None
            return await self._nursery.start(self._dialled, stream, (host, port), peer_id, True)
        finally:
            del self._dialling[(host, port)]
            done.set()

    def _reusable(self, host: str, port: int, peer_id: bytes | None) -> Connection | None:
        if peer_id is not None:
            return self.connection(peer_id)
        known = self._dialled_ids.get((host, port))
        return None if known is None else self.connection(known)

    async def connect_stream(
        self, stream: trio.abc.Stream, remote_address: tuple[str, int], *, peer_id: bytes | None = None
    ) -> Connection:
        """Handshake as the dialling side over an already open stream (in-memory tests)."""
        if self._nursery is None:
            raise RuntimeError("Transport.serve() or Transport.run() must be running to connect")
        return await self._nursery.start(self._dialled, stream, remote_address, peer_id, False)

    async def _dialled(self, stream: trio.abc.Stream, remote: tuple[str, int], expected: bytes | None,
                       remember: bool, *, task_status: trio.TaskStatus[Connection]) -> None:
        reader = StreamReader(stream)
        try:
            with trio.fail_after(self.config.handshake_timeout_s):
                hs = await self._handshake_initiator(stream, reader)
        except trio.TooSlowError:
            await trio.aclose_forcefully(stream)
            raise HandshakeError(f"handshake with {remote[0]}:{remote[1]} timed out") from None
        except (ConnectionClosed, trio.BrokenResourceError) as e:
            await trio.aclose_forcefully(stream)
            raise HandshakeError(
                f"{remote[0]}:{remote[1]} closed the connection during the handshake ({e}); "
                "it may be busy, rate-limiting us, or not a dtfm peer"
            ) from None
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        if expected is not None and hs.peer_id != expected:
            await trio.aclose_forcefully(stream)
            raise HandshakeError(
                f"{remote[0]}:{remote[1]} is peer {short_id(hs.peer_id)}, not the expected peer {short_id(expected)}"
            )
        if remember:
            self._dialled_ids[remote] = hs.peer_id
            self._dialled_ids.move_to_end(remote)
            if len(self._dialled_ids) > MAX_DIALLED_ADDRESSES:
                self._dialled_ids.popitem(last=False)
        await self._run_connection(stream, reader, hs, self.peer_id, remote, task_status)

    async def _handshake_initiator(self, stream: trio.abc.Stream, reader: StreamReader) -> HandshakeResult:
        init = Initiator(self.identity, self._swarm_key, PeerHello(self.region, self.listen_address), self._suites,
                         wall_clock=self._wall_clock)
        await _send_hs(stream, init.first_message())
        msg3, hs = init.on_response(await _recv_hs(reader))
        await _send_hs(stream, msg3)
        return hs

    # ---- accepting ---------------------------------------------------------------------

    async def _serve_tcp(self, stream: trio.SocketStream) -> None:
        try:
            remote = stream.socket.getpeername()[:2]
        except OSError:
            await trio.aclose_forcefully(stream)
            return
        try:
            await self.accept_stream(stream, (str(remote[0]), int(remote[1])))
        except Exception:
            # One peer's connection must never take the listener down.
            logger.exception("connection from %s:%s failed", remote[0], remote[1])

    async def accept_stream(self, stream: trio.abc.Stream, remote: tuple[str, int]) -> None:
        """Handshake as the accepting side and serve the connection until it ends."""
        refusal = "closing" if self._closed else self._admission.arrive(remote[0])
        if refusal is not None:
            logger.debug("refused connection from %s:%d: %s", remote[0], remote[1], refusal)
            await trio.aclose_forcefully(stream)
            return
        reader = StreamReader(stream)
        try:
            hs = await self._accept_handshake(stream, reader, remote)
        except _Refused as e:
            if e.warn:
                self._warn_refused(remote, str(e))
            else:
                logger.debug("refused handshake from %s:%d: %s", remote[0], remote[1], e)
            hs = None
        except (ProtocolError, ConnectionClosed) as e:
            logger.debug("bad handshake from %s:%d: %s", remote[0], remote[1], e)
            hs = None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            logger.debug("handshake from %s:%d broke: %s", remote[0], remote[1], e)
            hs = None
        if hs is None:
            await trio.aclose_forcefully(stream)
            return
        await self._run_connection(stream, reader, hs, hs.peer_id, remote, trio.TASK_STATUS_IGNORED)

    def _warn_refused(self, remote: tuple[str, int], reason: str) -> None:
        """A refused handshake, at WARNING with its reason: the connecting side learns only that it
        was refused, so this log is where an operator finds out why (another swarm's key, a
        stale clock, another protocol version). At most one line per source host a minute."""
        left_out = self._refusal_log.admit(source_key(remote[0]), trio.current_time())
        if left_out is not None:
            more = (f" ({left_out} more from {remote[0]} in the last {self._refusal_log.interval_s:g} s "
                    "not logged)" if left_out else "")
            logger.warning("refused handshake from %s:%d: %s%s", remote[0], remote[1], reason, more)

    async def _accept_handshake(self, stream: trio.abc.Stream, reader: StreamReader,
                                remote: tuple[str, int]) -> HandshakeResult:
        """Wait for the hello as a pending connection, then take a handshake slot for it."""
        host = remote[0]
        msg1: bytes | None = None
        try:
            with trio.move_on_after(self.config.hello_timeout_s):
                msg1 = await _recv_hs(reader)
        finally:
            self._admission.left(host)
        if msg1 is None:
            raise _Refused(f"no hello within {self.config.hello_timeout_s} s")
        refusal = self._admission.admit(host, trio.current_time())
        if refusal is not None:
            raise _Refused(refusal, warn=True)
        try:
            with trio.move_on_after(self.config.handshake_timeout_s):
                return await self._handshake_responder(stream, reader, msg1)
            raise _Refused(f"handshake timed out after {self.config.handshake_timeout_s} s")
        finally:
            self._admission.finished(host)

    async def _handshake_responder(self, stream: trio.abc.Stream, reader: StreamReader,
                                   msg1: bytes) -> HandshakeResult:
        resp = Responder(self.identity, self._swarm_key, PeerHello(self.region, self.listen_address), self._suites,
                         guard=self._hello_guard, wall_clock=self._wall_clock)
        try:
            msg2 = resp.on_hello(msg1)
        except HandshakeError as e:
            # The reason stays here: the peer, member or not, learns only that we refused.
            with trio.move_on_after(self.config.close_timeout_s):
                await _send_hs(stream, reject_message(REFUSAL))
            raise _Refused(str(e), warn=True) from None
        await _send_hs(stream, msg2)
        try:
            return resp.on_finish(await _recv_hs(reader))
        except HandshakeError as e:
            raise _Refused(str(e), warn=True) from None

    # ---- connection registry -----------------------------------------------------------

    async def _run_connection(self, stream: trio.abc.Stream, reader: StreamReader, hs: HandshakeResult,
                              initiator_id: bytes, remote: tuple[str, int],
                              task_status: trio.TaskStatus[Connection]) -> None:
        conn = Connection(
            stream,
            reader,
            hs,
            initiator_id=initiator_id,
            remote_address=remote,
            config=self.config,
            handlers=self._handlers,
            shaper=self._shaper,
            budget=self._payload_budget,
            refusals=self.refusals,
        )
        self._all.add(conn)
        announced = False
        loser: Connection | None = None

        def ready() -> None:
            nonlocal announced, loser
            existing = self.connection(conn.peer_id)
            if existing is not None and existing is not conn and _keeps_existing(existing, conn):
                loser = conn
                return
            loser = existing
            self._by_peer[conn.peer_id] = conn
            announced = True
            logger.debug("connected to %s at %s:%d (region %r)", conn.short_id, remote[0], remote[1], conn.region)
            for cb in self._on_connect:
                cb(conn)

        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(conn.run, ready)
                if loser is not None:  # (what either end had in flight on it still arrives)
                    nursery.start_soon(loser.retire, "duplicate connection", self.config.idle_timeout_s)
                task_status.started(self._by_peer.get(conn.peer_id, conn) if loser is conn else conn)
        finally:
            self._all.discard(conn)
            if self._by_peer.get(conn.peer_id) is conn:
                del self._by_peer[conn.peer_id]
            if announced:
                logger.debug("disconnected from %s: %s", conn.short_id, conn.close_reason)
                for cb in self._on_disconnect:
                    cb(conn, conn.close_reason)


class _Refused(Exception):
    """An incoming connection or handshake refused; `str()` is the reason for the local log.
    `warn`: an operator should hear of it (a peer with the wrong key, a flood the admission
    limits refused), not a connection that merely went quiet."""

    def __init__(self, reason: str, *, warn: bool = False):
        super().__init__(reason)
        self.warn = warn


def _keeps_existing(existing: Connection, new: Connection) -> bool:
    """True when `existing` should stay and `new` be closed (see the module docstring)."""
    if existing.initiator_id == new.initiator_id:
        return False
    return existing.initiator_id < new.initiator_id


async def _send_hs(stream: trio.abc.SendStream, msg: bytes) -> None:
    await stream.send_all(encode_prefix(len(msg)) + msg)


async def _recv_hs(reader: StreamReader) -> bytes:
    n = int.from_bytes(await reader.read_exactly(4), "big")
    if n > MAX_HANDSHAKE_BYTES:
        raise ProtocolError(f"handshake message of {n} bytes exceeds {MAX_HANDSHAKE_BYTES}")
    return bytes(await reader.read_exactly(n))
