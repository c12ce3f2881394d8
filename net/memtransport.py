"""`MemTransport` and `MemConnection`: the in-memory implementation of `PeerTransport` and
`PeerConnection`, over a `MemNetwork`.

They keep the contract of the TCP transport (handlers, replies, error replies, timeouts,
closing on a handler's `ProtocolError`, disconnect callbacks) through the same `dispatch`
code; what differs is below the interface:

- dialling is instantaneous (no handshake), and a dial never crosses another: a connection
  exists at both ends from the moment `connect()` returns;
- bodies go through msgpack both ways (`unpack_untrusted` with the frame limit), payloads are
  copied when sent and arrive as writable memoryviews;
- no keepalives and no idle timeout: across a cut link a connection stays open and loses every
  frame, as a TCP connection does until its timeouts fire;
- `kill()` is a process dying: its connections close and the peers are told (after the link
  delay); `stall` stops a node reading and sending;
- a node whose receive queue is full drops droppable frames and resets the connection of any
  other, rather than lose a frame the sender relies on.

TransportConfig fields honoured: request_timeout_s, max_control_frame_bytes,
max_payload_bytes, max_concurrent_handlers.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, NamedTuple

import trio

from .config import TransportConfig
from .dispatch import Dispatcher, Registry, Requests, encode_body
from .errors import ConnectionClosed, HandshakeError, ProtocolError
from .frames import MAX_CLOSE_REASON_BYTES
from .identity import short_id
from .interface import Payload
from .wire import unpack_untrusted

if TYPE_CHECKING:
    from .memnet import MemNetwork

__all__ = ["MemConnection", "MemTransport"]

logger = logging.getLogger(__name__)

FRAME_OVERHEAD = 32  # header + AEAD tag, roughly what the real transport adds per frame
INBOX_FRAMES = 4096  # frames a node holds unread before it drops or resets

MESSAGE, REQUEST, REPLY, ERROR, CLOSE = range(5)  # MemFrame.kind


class MemFrame(NamedTuple):
    link: int  # the connection, as both ends know it
    kind: int
    msg_type: int
    ref: int  # the message id; for REPLY and ERROR, the id of the request answered
    data: bytes  # msgpack body; for CLOSE, the reason
    payload: bytearray | None
    droppable: bool


class MemTransport(Registry["MemConnection"]):
    """One node's end of a MemNetwork. Create it with `MemNetwork.add()`, run `serve()`."""

    def __init__(self, net: MemNetwork, peer_id: bytes, region: str, address: tuple[str, int],
                 config: TransportConfig) -> None:
        super().__init__()
        self.net = net
        self.peer_id = peer_id
        self.short_id = short_id(peer_id)
        self.region = region
        self.listen_address = address
        self.config = config
        self.killed = False
        self.stalled_until = -math.inf
        self._links: dict[int, MemConnection] = {}
        self._inbox_send, self._inbox = trio.open_memory_channel[MemFrame](INBOX_FRAMES)
        self._nursery: trio.Nursery | None = None
        self._closed = False

    # ---- PeerTransport (registration and lookup: Registry) ---------------------------------

    async def connect(self, host: str, port: int, *, peer_id: bytes | None = None) -> MemConnection:
        """A connection to the node at host:port, reusing a live one; ConnectionClosed when
        the node is gone or the link is cut. With `peer_id`, only a connection to that peer
        is reused and a node at host:port with another id is refused (HandshakeError)."""
        await trio.lowlevel.checkpoint()
        other = self.net.by_address.get((host, port))
        # The network knows who listens where: a node's announced listen address plays no part.
        known = peer_id
        if known is None and other is not None:
            known = other.peer_id
        conn = None if known is None else self.connection(known)
        if conn is not None:
            return conn
        if self._closed or self.killed:
            raise ConnectionClosed("transport closed")
        if self._nursery is None:
            raise RuntimeError("MemTransport.serve() must be running to connect")
        if other is None or other.killed or other._nursery is None or (self.peer_id, other.peer_id) in self.net.cut:
            raise ConnectionClosed(f"cannot connect to {host}:{port}")
        if other.peer_id == self.peer_id:
            raise HandshakeError(f"{host}:{port} is this peer")
        if peer_id is not None and other.peer_id != peer_id:
            raise HandshakeError(
                f"{host}:{port} is peer {other.short_id}, not the expected peer {short_id(peer_id)}"
            )
        link = next(self.net.link_ids)
        mine = MemConnection(self, other, link)
        other._register(MemConnection(other, self, link))
        self._register(mine)
        return mine

    async def aclose(self) -> None:
        """Close every connection (telling the peers) and stop serving."""
        self._closed = True
        for conn in list(self._links.values()):
            conn._shut("transport closing", notify=True)
        await trio.lowlevel.checkpoint()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # ---- running ------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Receive frames and run handlers until cancelled; then the connections close."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                async for frame in self._inbox:
                    if trio.current_time() < self.stalled_until:
                        await trio.sleep_until(self.stalled_until)
                    conn = self._links.get(frame.link)
                    if conn is None:
                        logger.debug("%s: frame for a closed connection dropped", self.short_id)
                        continue
                    conn._receive(frame, nursery)
        finally:
            self._nursery = None
            self._closed = True
            for conn in list(self._links.values()):
                conn._shut("transport stopped", notify=True)

    def kill(self) -> None:
        """The node dies: its connections close and the peers learn it after the link delay."""
        self.killed = True
        for conn in list(self._links.values()):
            conn._shut("connection reset: peer killed", notify=True)

    # ---- connection registry -----------------------------------------------------------

    def _register(self, conn: MemConnection) -> None:
        old = self.connection(conn.peer_id)
        self._by_peer[conn.peer_id] = conn
        self._links[conn.link] = conn
        logger.debug("connected to %s at %s:%d (region %r)", conn.short_id, *conn.remote_address, conn.region)
        for cb in self._on_connect:
            cb(conn)
        if old is not None:  # a restarted peer dialled again before its old connection closed
            old._shut("duplicate connection", notify=True)

    def _unregister(self, conn: MemConnection) -> None:
        self._links.pop(conn.link, None)
        if self._by_peer.get(conn.peer_id) is conn:
            del self._by_peer[conn.peer_id]
        logger.debug("disconnected from %s: %s", conn.short_id, conn.close_reason)
        for cb in self._on_disconnect:
            cb(conn, conn.close_reason)

    def _arrive(self, frame: MemFrame) -> None:
        try:
            self._inbox_send.send_nowait(frame)
        except trio.WouldBlock:
            conn = self._links.get(frame.link)
            if frame.droppable or conn is None:
                logger.warning("%s: receive queue full, dropped a frame", self.short_id)
            else:
                logger.warning("%s: receive queue full, resetting the connection to %s", self.short_id, conn.short_id)
                conn._shut("receive queue full", notify=True)


class MemConnection:
    """One end of a connection between two MemTransports."""

    def __init__(self, local: MemTransport, remote: MemTransport, link: int) -> None:
        self.peer_id = remote.peer_id
        self.short_id = short_id(remote.peer_id)
        self.region = remote.region
        self.listen_address = remote.listen_address
        self.remote_address = remote.listen_address
        self.link = link
        self.closed = False
        self.close_reason = ""
        self.payload_bytes_sent = 0
        self.payload_bytes_received = 0
        self.last_seen = trio.current_time()
        self._local = local
        self._remote = remote
        self._config = local.config
        self._requests = Requests(self.short_id)
        self._dispatcher = Dispatcher(self, local._handlers, local.config.max_concurrent_handlers, local.refusals)
        self._next_id = 1

    def __repr__(self) -> str:
        return f"MemConnection({self._local.short_id} -> {self.short_id} #{self.link})"

    # ---- PeerConnection ------------------------------------------------------------------

    async def request(self, msg_type: int, body: object, *, payload: Payload | None = None,
                      timeout_s: float | None = None) -> tuple[object, memoryview | None]:
        timeout = self._config.request_timeout_s if timeout_s is None else timeout_s
        msg_id = self._take_id()

        async def send() -> None:
            await self._send(REQUEST, msg_type, msg_id, body, payload, False)

        return await self._requests.call(self, msg_id, msg_type, send, timeout)

    async def send(self, msg_type: int, body: object, *, payload: Payload | None = None,
                   droppable: bool = False) -> None:
        await self._send(MESSAGE, msg_type, self._take_id(), body, payload, droppable)

    async def close(self, reason: str = "") -> None:
        self._shut(reason or "closed locally", notify=True)
        await trio.lowlevel.checkpoint()

    # ---- sending ----------------------------------------------------------------------------

    def _take_id(self) -> int:
        msg_id = self._next_id
        self._next_id += 1
        return msg_id

    async def _send(self, kind: int, msg_type: int, ref: int, body: object, payload: Payload | None,
                    droppable: bool) -> None:
        if self.closed:
            raise ConnectionClosed(self.close_reason)
        n = 0 if payload is None else memoryview(payload).nbytes
        data = encode_body(msg_type, body, n, self._config)
        local = self._local
        if trio.current_time() < local.stalled_until:
            await trio.sleep_until(local.stalled_until)
            if self.closed:
                raise ConnectionClosed(self.close_reason)
        frame = MemFrame(self.link, kind, msg_type, ref, data, bytearray(payload) if payload is not None and n else None,
                         droppable and n == 0)
        self.payload_bytes_sent += n  # handed over to send
        local.net.transmit(local, self._remote, frame, FRAME_OVERHEAD + len(data) + n)
        await trio.lowlevel.checkpoint()

    def _shut(self, reason: str, *, notify: bool) -> None:
        """Close this end now: fail waiting requests, stop handlers, tell the other end."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        self._requests.close(reason)
        self._dispatcher.cancel()
        if notify:
            text = reason.encode("utf-8", "replace")[:MAX_CLOSE_REASON_BYTES]
            frame = MemFrame(self.link, CLOSE, 0, 0, text, None, False)
            self._local.net.transmit(self._local, self._remote, frame, FRAME_OVERHEAD + len(text))
        self._local._unregister(self)

    # ---- receiving ----------------------------------------------------------------------

    def _receive(self, frame: MemFrame, nursery: trio.Nursery) -> None:
        self.last_seen = trio.current_time()
        if frame.kind == CLOSE:
            self._shut(f"closed by peer: {frame.data.decode('utf-8', 'replace')}", notify=False)
            return
        try:
            body = unpack_untrusted(frame.data, max_len=self._config.max_control_frame_bytes)
        except ProtocolError as e:
            logger.debug("closing connection to %s (%s): bad input: %s", self.short_id, self.remote_address[0], e)
            self._shut(f"protocol error: {e}", notify=True)
            return
        payload = None if frame.payload is None else memoryview(frame.payload)
        if payload is not None:
            self.payload_bytes_received += payload.nbytes
        if frame.kind == REPLY:
            self._requests.reply(frame.ref, body, payload)
        elif frame.kind == ERROR:
            self._requests.error(frame.ref, body)
        else:
            self._dispatcher.deliver(nursery, frame.msg_type, frame.ref, body, payload, frame.kind == REQUEST)

    # ---- hooks for the dispatcher ---------------------------------------------------------

    async def _respond(self, msg_type: int, msg_id: int, body: object, payload: Payload | None) -> None:
        await self._send(REPLY, msg_type, msg_id, body, payload, False)

    async def _respond_error(self, msg_id: int, reason: str) -> None:
        try:
            await self._send(ERROR, 0, msg_id, reason, None, True)
        except ConnectionClosed:
            pass

    async def _abort(self, reason: str) -> None:
        self._shut(reason, notify=True)
        await trio.lowlevel.checkpoint()
