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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from .connection import KEEPALIVE, PING, Connection, Handler, Reply
from .errors import ConnectionClosed, HandshakeError, ProtocolError
from .handshake import MAX_HANDSHAKE_BYTES, HandshakeResult, Initiator, PeerHello, Responder, reject_message
from .identity import Identity
from .ratelimit import HandshakeAdmission
from .session import SUITES, encode_prefix
from .shaping import LinkShape, LinkShaper, PriorityShape
from .streamio import StreamReader

__all__ = [
    "Connection",
    "Handler",
    "KEEPALIVE",
    "LinkShape",
    "LinkShaper",
    "PING",
    "PriorityShape",
    "Reply",
    "Transport",
    "TransportConfig",
]

logger = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class TransportConfig:
    # Largest message frame (header + msgpack body). Bigger allows larger control messages; every
    # body is decoded in one go on the event loop, so it also bounds the time one decode takes.
    max_control_frame_bytes: int = 1 * MiB
    # Largest raw payload (tensor bytes) of one message; the receiver allocates it on the header.
    max_payload_bytes: int = 2048 * MiB
    # Payload bytes per chunk frame: smaller chunks let control frames overtake sooner, larger
    # ones cost fewer records and syscalls.
    chunk_bytes: int = 1 * MiB
    # Incomplete payloads a peer may have in flight to us at once, in count and in bytes.
    max_inflight_payloads: int = 16
    max_inflight_payload_bytes: int = 4096 * MiB
    # Default time a request waits for its reply (sending included).
    request_timeout_s: float = 30.0
    # TCP connect plus the three handshake messages.
    handshake_timeout_s: float = 10.0
    # Session keys are ratcheted after this long or this many records, whichever comes first;
    # the record counter is 64 bits, so the count limit sits far below a wrap.
    rekey_interval_s: float = 120.0
    rekey_after_records: int = 2**32
    # Handshakes in progress at once, over all sources; excess connections are closed at once.
    max_half_open_handshakes: int = 64
    # Handshake attempts per source host: sustained rate and burst (token bucket).
    handshake_rate_per_s: float = 5.0
    handshake_burst: int = 20
    # With nothing to send for this long a keepalive frame goes out; nothing received for
    # idle_timeout_s closes the connection. Keep idle > 2 x keepalive.
    keepalive_interval_s: float = 15.0
    idle_timeout_s: float = 60.0
    # A single record write that makes no progress for this long closes the connection.
    send_stall_timeout_s: float = 60.0
    # Time allowed to tell the peer why we close.
    close_timeout_s: float = 1.0
    # Handlers running at once per connection; more requests get a "busy" error reply.
    max_concurrent_handlers: int = 64
    # Control frames queued per connection before senders wait (droppable ones are dropped).
    max_queued_control_frames: int = 256
    # Records at least this large are encrypted/decrypted on worker threads, overlapping crypto
    # with socket I/O; 0 keeps all crypto on the event loop. Threads pay off with idle cores
    # to spare; on a busy 2-core host they cost about 0.6 CPU s per GiB in hand-offs.
    crypto_thread_min_bytes: int = 0
    # Record ciphers offered in the handshake, preferred first; None offers what this machine
    # runs fast (AEGIS-256 with hardware AES, and ChaCha20-Poly1305).
    cipher_suites: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_control_frame_bytes < 1024:
            raise ValueError("max_control_frame_bytes must be at least 1024")
        if self.chunk_bytes < 1 or self.chunk_bytes > 64 * MiB:
            raise ValueError("chunk_bytes must be in 1..64 MiB")
        if self.max_payload_bytes < 0 or self.max_inflight_payload_bytes < self.max_payload_bytes:
            raise ValueError("need 0 <= max_payload_bytes <= max_inflight_payload_bytes")
        if self.max_inflight_payloads < 1:
            raise ValueError("max_inflight_payloads must be >= 1")
        for name in ("request_timeout_s", "handshake_timeout_s", "rekey_interval_s", "keepalive_interval_s",
                     "send_stall_timeout_s", "close_timeout_s", "handshake_rate_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.idle_timeout_s <= 2 * self.keepalive_interval_s:
            raise ValueError("idle_timeout_s must exceed 2 x keepalive_interval_s")
        if not 1 <= self.rekey_after_records <= 2**62:
            raise ValueError("rekey_after_records must be in 1..2^62")
        if self.max_half_open_handshakes < 1 or self.handshake_burst < 1:
            raise ValueError("max_half_open_handshakes and handshake_burst must be >= 1")
        if self.cipher_suites is not None and (
            not self.cipher_suites or any(c not in SUITES for c in self.cipher_suites)
        ):
            raise ValueError(f"cipher_suites must be a non-empty subset of {sorted(SUITES)}")
        if self.crypto_thread_min_bytes < 0:
            raise ValueError("crypto_thread_min_bytes must be >= 0")
        if self.max_concurrent_handlers < 1 or self.max_queued_control_frames < 1:
            raise ValueError("max_concurrent_handlers and max_queued_control_frames must be >= 1")

    @classmethod
    def default(cls) -> "TransportConfig":
        return cls()

    @classmethod
    def test(cls) -> "TransportConfig":
        """Small limits and short timeouts; renews keys often so tests exercise renewal."""
        return cls(
            max_control_frame_bytes=64 * 1024,
            max_payload_bytes=64 * MiB,
            chunk_bytes=64 * 1024,
            max_inflight_payload_bytes=128 * MiB,
            request_timeout_s=5.0,
            handshake_timeout_s=2.0,
            rekey_interval_s=10.0,
            rekey_after_records=64,
            max_half_open_handshakes=16,
            handshake_rate_per_s=50.0,
            handshake_burst=50,
            keepalive_interval_s=2.0,
            idle_timeout_s=10.0,
            send_stall_timeout_s=5.0,
            close_timeout_s=0.5,
        )


class Transport:
    def __init__(
        self,
        identity: Identity,
        swarm_key: bytes,
        config: TransportConfig,
        *,
        region: str = "",
        shaper: LinkShaper | None = None,
    ) -> None:
        if len(swarm_key) != 32:
            raise ValueError("the swarm key is 32 bytes")
        self.identity = identity
        self.peer_id = identity.peer_id
        self.region = region
        self.config = config
        self.listen_address: tuple[str, int] = ("", 0)
        self._swarm_key = bytes(swarm_key)
        self._suites = None if config.cipher_suites is None else list(config.cipher_suites)
        self._shaper = shaper
        self._handlers: dict[int, Handler] = {}
        self._on_connect: list[Callable[[Connection], None]] = []
        self._on_disconnect: list[Callable[[Connection, str], None]] = []
        self._by_peer: dict[bytes, Connection] = {}
        self._all: set[Connection] = set()
        self._admission = HandshakeAdmission(
            config.handshake_rate_per_s, config.handshake_burst, config.max_half_open_handshakes
        )
        self._nursery: trio.Nursery | None = None
        self._closed = False

    # ---- registration ------------------------------------------------------------------

    def handle(self, msg_type: int, handler: Handler) -> None:
        if msg_type in (PING, KEEPALIVE) or not 0 <= msg_type <= 255:
            raise ValueError(f"message type {msg_type} is reserved or out of range")
        if msg_type in self._handlers:
            raise ValueError(f"message type {msg_type} already has a handler")
        self._handlers[msg_type] = handler

    def on_connect(self, cb: Callable[[Connection], None]) -> None:
        self._on_connect.append(cb)

    def on_disconnect(self, cb: Callable[[Connection, str], None]) -> None:
        self._on_disconnect.append(cb)

    def connection(self, peer_id: bytes) -> Connection | None:
        conn = self._by_peer.get(peer_id)
        return conn if conn is not None and not conn.closed else None

    def connections(self) -> list[Connection]:
        return [c for c in self._by_peer.values() if not c.closed]

    # ---- running -----------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Host connections without listening (dial-only peers, in-memory tests)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
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

    async def connect(self, host: str, port: int) -> Connection:
        """A connection to the peer listening at host:port, reusing a live one."""
        for conn in self.connections():
            if (host, port) in (conn.remote_address, conn.listen_address):
                return conn
        if self._closed:
            raise ConnectionClosed("transport closed")
        if self._nursery is None:
            raise RuntimeError("Transport.serve() or Transport.run() must be running to connect")
        try:
            with trio.fail_after(self.config.handshake_timeout_s):
                stream = await trio.open_tcp_stream(host, port)
        except trio.TooSlowError:
            raise TimeoutError(f"connecting to {host}:{port} timed out") from None
        return await self._nursery.start(self._dialled, stream, (host, port))

    async def connect_stream(self, stream: trio.abc.Stream, remote_address: tuple[str, int]) -> Connection:
        """Handshake as the dialling side over an already open stream (in-memory tests)."""
        if self._nursery is None:
            raise RuntimeError("Transport.serve() or Transport.run() must be running to connect")
        return await self._nursery.start(self._dialled, stream, remote_address)

    async def _dialled(self, stream: trio.abc.Stream, remote: tuple[str, int], *, task_status) -> None:
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
        await self._run_connection(stream, reader, hs, self.peer_id, remote, task_status)

    async def _handshake_initiator(self, stream, reader) -> HandshakeResult:
        init = Initiator(self.identity, self._swarm_key, PeerHello(self.region, self.listen_address), self._suites)
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
        refusal = self._admission.admit(remote[0], trio.current_time())
        if refusal is not None or self._closed:
            logger.debug("refused connection from %s:%d: %s", remote[0], remote[1], refusal or "closing")
            await trio.aclose_forcefully(stream)
            return
        reader = StreamReader(stream)
        try:
            with trio.fail_after(self.config.handshake_timeout_s):
                hs = await self._handshake_responder(stream, reader, remote)
        except trio.TooSlowError:
            logger.debug("handshake from %s:%d timed out", remote[0], remote[1])
            hs = None
        except _AlreadyLogged:
            hs = None
        except HandshakeError as e:
            logger.warning("refused handshake from %s:%d: %s", remote[0], remote[1], e)
            hs = None
        except (ProtocolError, ConnectionClosed) as e:
            logger.debug("bad handshake from %s:%d: %s", remote[0], remote[1], e)
            hs = None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            logger.debug("handshake from %s:%d broke: %s", remote[0], remote[1], e)
            hs = None
        finally:
            self._admission.finished()
        if hs is None:
            await trio.aclose_forcefully(stream)
            return
        await self._run_connection(stream, reader, hs, hs.peer_id, remote, trio.TASK_STATUS_IGNORED)

    async def _handshake_responder(self, stream, reader, remote) -> HandshakeResult:
        resp = Responder(self.identity, self._swarm_key, PeerHello(self.region, self.listen_address), self._suites)
        try:
            msg2 = resp.on_hello(await _recv_hs(reader))
        except HandshakeError as e:
            logger.warning("refused handshake from %s:%d: %s", remote[0], remote[1], e)
            with trio.move_on_after(self.config.close_timeout_s):
                await _send_hs(stream, reject_message(str(e)))
            raise _AlreadyLogged() from e
        await _send_hs(stream, msg2)
        return resp.on_finish(await _recv_hs(reader))

    # ---- connection registry -----------------------------------------------------------

    async def _run_connection(self, stream, reader, hs, initiator_id, remote, task_status) -> None:
        conn = Connection(
            stream,
            reader,
            hs,
            initiator_id=initiator_id,
            remote_address=remote,
            config=self.config,
            handlers=self._handlers,
            shaper=self._shaper,
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
                if loser is not None:
                    nursery.start_soon(loser.close, "duplicate connection")
                task_status.started(self._by_peer.get(conn.peer_id, conn) if loser is conn else conn)
        finally:
            self._all.discard(conn)
            if self._by_peer.get(conn.peer_id) is conn:
                del self._by_peer[conn.peer_id]
            if announced:
                logger.debug("disconnected from %s: %s", conn.short_id, conn.close_reason)
                for cb in self._on_disconnect:
                    cb(conn, conn.close_reason)


class _AlreadyLogged(Exception):
    """A refused handshake whose reason was logged before the refusal was sent."""


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
