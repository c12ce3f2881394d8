"""One authenticated, encrypted connection to a peer: request/response, one-way messages,
payload chunking, handler dispatch and keepalive, over the record layer in `records`."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from . import frames
from .errors import ConnectionClosed, ProtocolError, RemoteError, RequestTimeout
from .handshake import HandshakeResult
from .identity import short_id
from .records import RecordReader, RecordWriter, max_record_bytes
from .session import TAG_BYTES, RecvCipher, SendCipher
from .shaping import LinkShape, LinkShaper, PriorityShape
from .streamio import StreamReader
from .wire import MAX_MSG_TYPE, pack

if TYPE_CHECKING:
    from .transport import TransportConfig

logger = logging.getLogger(__name__)

# Message types 0-3 belong to the transport itself; the daemon uses 4-31.
PING = 0  # request with an empty body, answered by the transport
KEEPALIVE = 1  # one-way, ignored; keeps an idle connection from timing out

# (conn, msg_type, body, payload) -> reply body (or Reply) for requests; payload is a writable
# memoryview of the raw bytes, or None.
Handler = Callable[["Connection", int, object, "memoryview | None"], Awaitable[object]]


@dataclass(frozen=True)
class Reply:
    """A handler's reply that carries a raw payload as well as a body."""

    body: object
    payload: bytes | bytearray | memoryview | None = None


class _Pending:
    __slots__ = ("event", "result", "error")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.result: tuple[object, memoryview | None] | None = None
        self.error: BaseException | None = None


class Connection:
    """A live connection to one peer. Created by `Transport` once the handshake succeeds."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        reader: StreamReader,
        hs: HandshakeResult,
        *,
        initiator_id: bytes,
        remote_address: tuple[str, int],
        config: "TransportConfig",
        handlers: dict[int, Handler],
        shaper: LinkShaper | None,
    ) -> None:
        self.peer_id: bytes = hs.peer_id
        self.short_id: str = short_id(hs.peer_id)
        self.region: str = hs.hello.region
        self.listen_address: tuple[str, int] = hs.hello.listen_address
        self.remote_address: tuple[str, int] = remote_address
        self.initiator_id = initiator_id
        self.closed = False
        self.close_reason = ""
        self.cipher_suite: str = hs.suite
        self._stream = stream
        self._config = config
        self._handlers = handlers
        self._shape: LinkShape = (
            shaper.open_link(self.peer_id, self.region)
            if shaper is not None
            else PriorityShape(max_control_frames=config.max_queued_control_frames)
        )
        max_record = max_record_bytes(config.max_control_frame_bytes, config.chunk_bytes, TAG_BYTES)
        self._out = RecordWriter(
            stream,
            SendCipher(hs.send_key, hs.suite),
            max_record=max_record,
            rekey_after_records=config.rekey_after_records,
            rekey_interval_s=config.rekey_interval_s,
            send_stall_timeout_s=config.send_stall_timeout_s,
            thread_min_bytes=config.crypto_thread_min_bytes,
            peer=self.short_id,
        )
        inbound = frames.Inbound(
            max_control_frame_bytes=config.max_control_frame_bytes,
            max_payload_bytes=config.max_payload_bytes,
            max_inflight_payload_bytes=config.max_inflight_payload_bytes,
            max_inflight_payloads=config.max_inflight_payloads,
        )
        self._in = RecordReader(
            reader,
            RecvCipher(hs.recv_key, hs.suite),
            inbound,
            max_record=max_record,
            idle_timeout_s=config.idle_timeout_s,
            thread_min_bytes=config.crypto_thread_min_bytes,
            peer=self.short_id,
        )
        self._pending: dict[int, _Pending] = {}
        self._next_id = 1
        self._handler_slots = config.max_concurrent_handlers
        self._cancel_scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._done = trio.Event()

    def __repr__(self) -> str:
        return f"Connection({self.short_id} {self.remote_address[0]}:{self.remote_address[1]})"

    # ---- public API ----------------------------------------------------------------------

    async def request(
        self,
        msg_type: int,
        body: Any,
        *,
        payload: bytes | bytearray | memoryview | None = None,
        timeout_s: float | None = None,
    ) -> tuple[object, memoryview | None]:
        """Send a request and wait for its reply `(body, payload)`; a payload arrives as a
        writable memoryview of bytes (`bytes(p)`, `torch.frombuffer(p, dtype=...)`)."""
        timeout = self._config.request_timeout_s if timeout_s is None else timeout_s
        msg_id = self._take_id()
        pending = _Pending()
        self._pending[msg_id] = pending
        try:
            with trio.move_on_after(timeout):
                await self._send_message(msg_type, frames.FLAG_REQUEST, msg_id, 0, body, payload, False)
                await pending.event.wait()
        finally:
            self._pending.pop(msg_id, None)
        if pending.error is not None:
            raise pending.error
        if pending.result is None:
            if self.closed:
                raise ConnectionClosed(self.close_reason)
            raise RequestTimeout(f"no reply from {self.short_id} to message type {msg_type} within {timeout} s")
        return pending.result

    async def send(
        self,
        msg_type: int,
        body: Any,
        *,
        payload: bytes | bytearray | memoryview | None = None,
        droppable: bool = False,
    ) -> None:
        """Send a one-way message. `droppable` lets a full queue or a lossy link drop it."""
        await self._send_message(msg_type, 0, self._take_id(), 0, body, payload, droppable)

    async def ping(self, timeout_s: float | None = None) -> float:
        """Round-trip time of a transport-level ping, in seconds."""
        t0 = trio.current_time()
        await self.request(PING, None, timeout_s=timeout_s)
        return trio.current_time() - t0

    async def close(self, reason: str = "") -> None:
        """Tell the peer why (best effort), close the connection and wait until it is gone."""
        if not self.closed:
            self._mark_closed(reason or "closed locally")
            with trio.move_on_after(self._config.close_timeout_s) as scope:
                scope.shield = True
                try:
                    await self._transmit(frames.encode_close(self.close_reason), flush=True)
                except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
            if self._cancel_scope is not None:
                self._cancel_scope.cancel()
        await self._done.wait()

    # ---- sending ------------------------------------------------------------------------

    def _take_id(self) -> int:
        msg_id = self._next_id
        self._next_id += 1
        return msg_id

    async def _send_message(self, msg_type, flags, msg_id, reply_to, body, payload, droppable) -> None:
        if self.closed:
            raise ConnectionClosed(self.close_reason)
        if not 0 <= msg_type <= MAX_MSG_TYPE:
            raise ValueError(f"message type {msg_type} out of range")
        encoded = pack(body)
        n = 0 if payload is None else len(payload)
        if n > self._config.max_payload_bytes:
            raise ValueError(f"payload of {n} bytes exceeds max_payload_bytes")
        frame = frames.encode_msg(msg_type, flags, msg_id, reply_to, encoded, n)
        if len(frame) > self._config.max_control_frame_bytes:
            raise ValueError(f"message body of {len(encoded)} bytes exceeds max_control_frame_bytes")
        await self._shape.submit(frame, droppable and n == 0)
        if n:
            view = memoryview(payload).cast("B")
            step = self._config.chunk_bytes
            for off in range(0, n, step):
                if self.closed:
                    raise ConnectionClosed(self.close_reason)
                await self._shape.submit(frames.encode_chunk(msg_id, view[off : off + step]), False)

    async def _transmit(self, frame: bytes, *, flush: bool = False) -> None:
        await self._out.transmit(frame, flush=flush)

    async def _transmit_from_shape(self, frame: bytes) -> None:
        try:
            await self._transmit(frame)
        except ConnectionClosed as e:
            self._mark_closed(str(e))
            if self._cancel_scope is not None:
                self._cancel_scope.cancel()
            raise _Stop() from None

    # ---- running ------------------------------------------------------------------------

    async def run(self, on_ready: Callable[[], None] | None = None, *, task_status=trio.TASK_STATUS_IGNORED) -> str:
        """Serve the connection until it closes; returns the reason."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._cancel_scope = nursery.cancel_scope
                nursery.start_soon(self._run_writer)
                nursery.start_soon(self._run_shape)
                nursery.start_soon(self._keepalive)
                if on_ready is not None:
                    on_ready()
                task_status.started()
                try:
                    await self._in.run(self._dispatch)
                except ProtocolError as e:
                    logger.debug("closing connection to %s (%s): bad input: %s", self.short_id, self.remote_address[0], e)
                    await self._close_quietly(f"protocol error: {e}")
                except ConnectionClosed as e:
                    self._mark_closed(str(e))
                nursery.cancel_scope.cancel()
        finally:
            self._mark_closed("connection closed")
            for p in self._pending.values():
                p.error = ConnectionClosed(self.close_reason)
                p.event.set()
            with trio.CancelScope(shield=True):
                await self._stream.aclose()
            self._done.set()
        return self.close_reason

    async def _close_quietly(self, reason: str) -> None:
        self._mark_closed(reason)
        with trio.move_on_after(self._config.close_timeout_s):
            try:
                await self._transmit(frames.encode_close(reason), flush=True)
            except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

    def _mark_closed(self, reason: str) -> None:
        if not self.closed:
            self.closed = True
            self.close_reason = reason

    @property
    def last_seen(self) -> float:
        """trio.current_time() when the last record from the peer arrived."""
        return self._in.last_seen

    async def _run_writer(self) -> None:
        try:
            await self._out.run()
        except ConnectionClosed as e:
            self._mark_closed(str(e))
            if self._cancel_scope is not None:
                self._cancel_scope.cancel()

    async def _run_shape(self) -> None:
        try:
            await self._shape.run(self._transmit_from_shape)
        except _Stop:
            pass

    async def _keepalive(self) -> None:
        interval = self._config.keepalive_interval_s
        while True:
            await trio.sleep_until(self._out.last_sent + interval)
            if trio.current_time() - self._out.last_sent >= interval:
                await self._shape.submit(frames.encode_msg(KEEPALIVE, 0, self._take_id(), 0, pack(None), 0), False)
                self._out.last_sent = trio.current_time()

    # ---- receiving ----------------------------------------------------------------------

    def _dispatch(self, msg: frames.Message) -> None:
        if msg.flags & frames.FLAG_RESPONSE:
            p = self._pending.get(msg.reply_to)
            if p is None:
                logger.debug("late or unknown reply %d from %s", msg.reply_to, self.short_id)
                return
            if msg.flags & frames.FLAG_ERROR:
                p.error = RemoteError(f"{self.short_id}: {str(msg.body)[:200]}")
            else:
                p.result = (msg.body, msg.payload)
            p.event.set()
            return
        is_request = bool(msg.flags & frames.FLAG_REQUEST)
        if msg.msg_type == KEEPALIVE and not is_request:
            return
        if msg.msg_type == PING:
            handler: Handler | None = _ping_handler
        else:
            handler = self._handlers.get(msg.msg_type)
        if handler is None:
            logger.debug("no handler for message type %d from %s", msg.msg_type, self.short_id)
            if is_request:
                self._spawn(self._reply_error, msg, f"unknown message type {msg.msg_type}")
            return
        if self._handler_slots <= 0:
            logger.warning("too many requests in progress from %s: dropped message type %d", self.short_id, msg.msg_type)
            if is_request:
                self._spawn(self._reply_error, msg, "busy")
            return
        self._handler_slots -= 1
        self._spawn(self._run_handler, handler, msg)

    def _spawn(self, fn, *args) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(fn, *args)

    async def _reply_error(self, msg: frames.Message, reason: str) -> None:
        try:
            await self._send_message(0, frames.FLAG_RESPONSE | frames.FLAG_ERROR, self._take_id(), msg.msg_id, reason, None, True)
        except ConnectionClosed:
            pass

    async def _run_handler(self, handler: Handler, msg: frames.Message) -> None:
        is_request = bool(msg.flags & frames.FLAG_REQUEST)
        try:
            try:
                result = await handler(self, msg.msg_type, msg.body, msg.payload)
            except ProtocolError as e:
                logger.debug("bad message type %d from %s: %s", msg.msg_type, self.short_id, e)
                await self._close_quietly(f"protocol error in message type {msg.msg_type}: {e}")
                if self._cancel_scope is not None:
                    self._cancel_scope.cancel()
                return
            except (ConnectionClosed, RequestTimeout, RemoteError) as e:
                logger.debug("handler for message type %d from %s failed: %s", msg.msg_type, self.short_id, e)
                if is_request:
                    await self._reply_error(msg, "handler failed")
                return
            except Exception:
                logger.exception("handler for message type %d from %s crashed", msg.msg_type, self.short_id)
                if is_request:
                    await self._reply_error(msg, "internal error")
                return
            if not is_request:
                return
            body, payload = (result.body, result.payload) if isinstance(result, Reply) else (result, None)
            try:
                await self._send_message(msg.msg_type, frames.FLAG_RESPONSE, self._take_id(), msg.msg_id, body, payload, False)
            except ConnectionClosed:
                pass
            except ValueError as e:  # the handler's reply cannot be encoded or is too large
                logger.error("reply to message type %d from %s not sent: %s", msg.msg_type, self.short_id, e)
                await self._reply_error(msg, "reply not encodable")
        finally:
            self._handler_slots += 1


class _Stop(Exception):
    """Ends the shape's run loop once the connection can no longer send."""


async def _ping_handler(conn: Connection, msg_type: int, body: object, payload: object) -> None:
    return None

