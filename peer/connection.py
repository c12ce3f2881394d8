"""One authenticated, encrypted connection to a peer: framing, request/response, keepalive."""

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
from .session import PREFIX_BYTES, TAG_BYTES, RecvCipher, SendCipher, parse_prefix
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
        self.last_seen: float = trio.current_time()
        self.closed = False
        self.close_reason = ""
        self._stream = stream
        self._reader = reader
        self._config = config
        self._handlers = handlers
        self._send = SendCipher(hs.send_key, hs.suite)
        self._recv = RecvCipher(hs.recv_key, hs.suite)
        self.cipher_suite: str = hs.suite
        self._last_rekey = trio.current_time()
        self._last_sent = trio.current_time()
        self._inbound = frames.Inbound(
            max_control_frame_bytes=config.max_control_frame_bytes,
            max_payload_bytes=config.max_payload_bytes,
            max_inflight_payload_bytes=config.max_inflight_payload_bytes,
            max_inflight_payloads=config.max_inflight_payloads,
        )
        self._shape: LinkShape = (
            shaper.open_link(self.peer_id, self.region)
            if shaper is not None
            else PriorityShape(max_control_frames=config.max_queued_control_frames)
        )
        self._max_record = max(config.max_control_frame_bytes, frames.CHUNK_HEADER_BYTES + config.chunk_bytes) + TAG_BYTES
        self._scratch = bytearray(min(self._max_record, 64 * 1024))  # decrypted frames
        self._outs = [bytearray(4096), bytearray(4096)]  # sealed records, used alternately
        self._out_index = 0
        self._to_writer, self._from_writer = trio.open_memory_channel(0)
        self._writer_running = False
        self._offload = config.crypto_thread_min_bytes
        self._pending: dict[int, _Pending] = {}
        self._next_id = 1
        self._handler_slots = config.max_concurrent_handlers
        self._send_lock = trio.Lock()
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
        """Encrypt one frame (renewing the key first when due) and hand it to the writer.

        Records are sealed into one of two alternating buffers while the writer task still
        sends the previous one; with `crypto_thread_min_bytes` set, large records are sealed
        on a worker thread (libsodium releases the GIL), overlapping encryption and sending.
        `flush` waits until the record is on the socket.
        """
        async with self._send_lock:
            now = trio.current_time()
            if (
                self._send.counter >= self._config.rekey_after_records
                or now - self._last_rekey >= self._config.rekey_interval_s
            ):
                await self._hand_to_writer(self._send.seal(frames.encode_rekey()))
                self._send.ratchet()
                self._last_rekey = now
            size = PREFIX_BYTES + len(frame) + self._send.tag_bytes
            i = self._out_index
            self._out_index ^= 1
            if len(self._outs[i]) < size:
                self._outs[i] = bytearray(max(size, min(2 * len(self._outs[i]), PREFIX_BYTES + self._max_record)))
            if self._offload and len(frame) >= self._offload:
                record = await trio.to_thread.run_sync(self._send.seal_into, frame, self._outs[i])
            else:
                record = self._send.seal_into(frame, self._outs[i])
            await self._hand_to_writer(record)
            if flush:
                await self._hand_to_writer(None)
            self._last_sent = now

    async def _hand_to_writer(self, record: bytearray | memoryview | None) -> None:
        # The channel is unbuffered: a hand-off completes once the writer has finished the
        # previous record, so the buffer sealed two records ago is free again.
        if self._writer_running:
            await self._to_writer.send(record)
        elif record is not None:
            await self._write(record)

    async def _writer(self) -> None:
        try:
            async for record in self._from_writer:
                if record is not None:
                    await self._write(record)
        except ConnectionClosed as e:
            self._mark_closed(str(e))
            if self._cancel_scope is not None:
                self._cancel_scope.cancel()
        finally:
            self._writer_running = False

    async def _write(self, record: bytearray | memoryview) -> None:
        try:
            with trio.fail_after(self._config.send_stall_timeout_s):
                await self._stream.send_all(record)
        except trio.TooSlowError:
            raise ConnectionClosed(f"send to {self.short_id} stalled") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise ConnectionClosed(f"connection to {self.short_id} lost: {e}") from None

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
                self._writer_running = True
                nursery.start_soon(self._writer)
                nursery.start_soon(self._run_shape)
                nursery.start_soon(self._keepalive)
                if on_ready is not None:
                    on_ready()
                task_status.started()
                try:
                    await self._read_loop()
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

    async def _run_shape(self) -> None:
        try:
            await self._shape.run(self._transmit_from_shape)
        except _Stop:
            pass

    async def _keepalive(self) -> None:
        interval = self._config.keepalive_interval_s
        while True:
            await trio.sleep_until(self._last_sent + interval)
            if trio.current_time() - self._last_sent >= interval:
                await self._shape.submit(frames.encode_msg(KEEPALIVE, 0, self._take_id(), 0, pack(None), 0), False)
                self._last_sent = trio.current_time()

    async def _read_loop(self) -> None:
        """Process records in order while the next one is being received.

        A receiver task reads whole records into two alternating buffers and hands them over
        an unbuffered channel (a hand-off completes once the previous record is processed, so
        its buffer is free again). With `crypto_thread_min_bytes` set, large records are
        decrypted and parsed on a worker thread while the next one arrives.
        """
        send, recv = trio.open_memory_channel(0)
        error: ProtocolError | ConnectionClosed | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_records, send)
            try:
                await self._process_records(recv)
            except (ProtocolError, ConnectionClosed) as e:
                error = e  # raised outside the nursery, so callers see it unwrapped
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error

    async def _process_records(self, recv: trio.MemoryReceiveChannel) -> None:
        async for item in recv:
            if isinstance(item, BaseException):
                raise item
            prefix, record = item
            if self._offload and len(record) >= self._offload:
                event = await trio.to_thread.run_sync(self._open_frame, prefix, record)
            else:
                event = self._open_frame(prefix, record)
            self.last_seen = trio.current_time()
            if event is None:
                continue
            if isinstance(event, frames.Message):
                self._dispatch(event)
            elif isinstance(event, frames.Rekey):
                self._recv.ratchet()
            elif isinstance(event, frames.Close):
                raise ConnectionClosed(f"closed by peer: {event.reason}")

    def _open_frame(self, prefix: bytes, record: memoryview) -> frames.Message | frames.Rekey | frames.Close | None:
        n = len(record)
        if len(self._scratch) < n:
            self._scratch = bytearray(max(n, min(2 * len(self._scratch), self._max_record)))
        return self._inbound.on_frame(self._recv.open_into(prefix, record, self._scratch))

    async def _receive_records(self, send: trio.MemorySendChannel) -> None:
        idle = self._config.idle_timeout_s
        bufs = [bytearray(4096), bytearray(4096)]
        i = 0
        async with send:
            while True:
                try:
                    with trio.move_on_after(idle) as scope:
                        prefix = bytes(await self._reader.read_exactly(PREFIX_BYTES))
                        n = parse_prefix(prefix, self._max_record, self._recv.tag_bytes)
                        if len(bufs[i]) < n:
                            bufs[i] = bytearray(max(n, min(2 * len(bufs[i]), self._max_record)))
                        record = memoryview(bufs[i])[:n]
                        await self._reader.read_into(record)
                    if scope.cancelled_caught:
                        raise ConnectionClosed(f"nothing received from {self.short_id} for {idle} s")
                except (ProtocolError, ConnectionClosed) as e:
                    await send.send(e)
                    return
                await send.send((prefix, record))
                i ^= 1

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

