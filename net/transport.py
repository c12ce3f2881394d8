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

import trio

from .config import TransportConfig
from .connection import Connection
from .dispatch import Registry
from .errors import ConnectionClosed, HandshakeError, ProtocolError
from .handshake import MAX_HANDSHAKE_BYTES, HandshakeResult, Initiator, PeerHello, Responder, reject_message
from .identity import Identity
from .ratelimit import HandshakeAdmission
from .session import encode_prefix
from .shaping import LinkShaper
from .streamio import StreamReader

__all__ = ["Transport"]

logger = logging.getLogger(__name__)


class Transport(Registry):
    """The TCP implementation of `PeerTransport`."""

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
        self._admission = HandshakeAdmission(
            config.handshake_rate_per_s, config.handshake_burst, config.max_half_open_handshakes
        )
        self._nursery: trio.Nursery | None = None
        self._closed = False

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
