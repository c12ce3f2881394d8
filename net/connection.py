"""One authenticated, encrypted connection to a peer: request/response, one-way messages,
payload chunking, handler dispatch and keepalive, over the record layer in `records`."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import trio

from . import frames
from .budget import PayloadBudget
from .config import TransportConfig
from .dispatch import KEEPALIVE, PING, Dispatcher, Refusals, Requests, encode_body
from .errors import ConnectionClosed, ProtocolError
from .handshake import HandshakeResult
from .identity import short_id
from .interface import Handler, Payload
from .records import RecordReader, RecordWriter, detach_chunks, max_record_bytes
from .session import TAG_BYTES, RecvCipher, SendCipher
from .shaping import LinkShape, LinkShaper, PriorityShape
from .streamio import StreamReader
from .wire import pack

logger = logging.getLogger(__name__)


class Connection:
    """A live connection to one peer (the TCP implementation of `PeerConnection`). Created by
    `Transport` once the handshake succeeds."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        reader: StreamReader,
        hs: HandshakeResult,
        *,
        initiator_id: bytes,
        remote_address: tuple[str, int],
        config: TransportConfig,
        handlers: dict[int, Handler],
        shaper: LinkShaper | None,
        budget: PayloadBudget | None = None,
        refusals: Refusals | None = None,
    ) -> None:
        self.peer_id: bytes = hs.peer_id
        self.short_id: str = short_id(hs.peer_id)
        self.region: str = hs.hello.region
        self.listen_address: tuple[str, int] = hs.hello.listen_address
        self.remote_address: tuple[str, int] = remote_address
        self.initiator_id = initiator_id
        self.closed = False
        self.close_reason = ""
        self.payload_bytes_sent = 0
        self.payload_bytes_received = 0
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
        self._inbound = frames.Inbound(
            max_control_frame_bytes=config.max_control_frame_bytes,
            max_payload_bytes=config.max_payload_bytes,
            max_inflight_payload_bytes=config.max_inflight_payload_bytes,
            max_inflight_payloads=config.max_inflight_payloads,
            budget=budget,
        )
        self._in = RecordReader(
            reader,
            RecvCipher(hs.recv_key, hs.suite),
            self._inbound,
            max_record=max_record,
            idle_timeout_s=config.idle_timeout_s,
            thread_min_bytes=config.crypto_thread_min_bytes,
            peer=self.short_id,
        )
        self._requests = Requests(self.short_id)
        self._dispatcher = Dispatcher(self, handlers, config.max_concurrent_handlers, refusals)
        self._next_id = 1
        self._cancel_scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._done = trio.Event()
        self._closing_frame: bytes | None = None
        self._close_sent = trio.Event()

    def __repr__(self) -> str:
        return f"Connection({self.short_id} {self.remote_address[0]}:{self.remote_address[1]})"

    # ---- public API ----------------------------------------------------------------------

    async def request(
        self,
        msg_type: int,
        body: object,
        *,
        payload: Payload | None = None,
        timeout_s: float | None = None,
    ) -> tuple[object, memoryview | None]:
        """Send a request and wait for its reply `(body, payload)`; a payload arrives as a
        writable memoryview of bytes (`bytes(p)`, `torch.frombuffer(p, dtype=...)`)."""
        timeout = self._config.request_timeout_s if timeout_s is None else timeout_s
        msg_id = self._take_id()

        async def send() -> None:
            await self._send_message(msg_type, frames.FLAG_REQUEST, msg_id, 0, body, payload, False)

        return await self._requests.call(self, msg_id, msg_type, send, timeout)

    async def send(
        self,
        msg_type: int,
        body: object,
        *,
        payload: Payload | None = None,
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
                    await self._send_close(frames.encode_close(self.close_reason))
                except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
            if self._cancel_scope is not None:
                self._cancel_scope.cancel()
        await self._done.wait()

    async def retire(self, reason: str, grace_s: float) -> None:
        """Close once nothing is in flight: the requests this end sent have their replies and
        the handlers of the other end's requests have answered (at most `grace_s`). A duplicate
        connection that lost to another is retired so: both ends stop choosing it for new
        messages, and what they had sent on it still arrives."""
        try:
            with trio.move_on_after(grace_s):
                # (a handler may send a request, a reply may start nothing: look at both again
                # until both are idle at once)
                while not self.closed and (self._requests.busy() or self._dispatcher.busy()):
                    await self._requests.wait_idle()
                    await self._dispatcher.wait_idle()
        finally:
            with trio.CancelScope(shield=True):
                await self.close(reason)

    # ---- sending ------------------------------------------------------------------------

    def _take_id(self) -> int:
        msg_id = self._next_id
        self._next_id += 1
        return msg_id

    async def _send_message(self, msg_type: int, flags: int, msg_id: int, reply_to: int, body: object,
                            payload: Payload | None, droppable: bool) -> None:
        if self.closed:
            raise ConnectionClosed(self.close_reason)
        n = 0 if payload is None else memoryview(payload).nbytes
        encoded = encode_body(msg_type, body, n, self._config)
        frame = frames.encode_msg(msg_type, flags, msg_id, reply_to, encoded, n)
        await self._shape.submit(frame, droppable and n == 0)
        if payload is not None and n:
            self.payload_bytes_sent += n  # handed over to send
            await self._send_chunks(msg_id, payload, n)

    async def _send_chunks(self, msg_id: int, payload: Payload, n: int) -> None:
        sent_all = False
        # Chunks are sealed straight from the caller's buffer; those still queued when this
        # returns are copied, so the caller may reuse the buffer (bytes cannot change).
        queued: deque[frames.Chunk] | None = None if isinstance(payload, bytes) else deque()
        try:
            view = memoryview(payload).cast("B")
            step = self._config.chunk_bytes
            for off in range(0, n, step):
                if self.closed:
                    raise ConnectionClosed(self.close_reason)
                chunk = frames.Chunk(msg_id, view[off : off + step])
                await self._shape.submit(chunk, False)
                if queued is not None:
                    while queued and queued[0].state == frames.Chunk.SEALED:
                        queued.popleft()
                    queued.append(chunk)
            sent_all = True
        finally:
            if queued:
                await detach_chunks(queued)
            if not sent_all and not self.closed and self._nursery is not None:
                # Given up part-way (a request timeout, a cancelled sender): without an ABORT
                # the receiver would hold the partial payload for the life of the connection.
                # Sent from the connection's nursery, as the sender here may be cancelled.
                try:
                    self._nursery.start_soon(self._send_abort, msg_id)
                except RuntimeError:  # the connection's nursery is closing
                    pass

    async def _send_abort(self, msg_id: int) -> None:
        logger.debug("gave up the payload of message %d to %s part-way: abort sent", msg_id, self.short_id)
        await self._shape.submit(frames.encode_abort(msg_id), False)

    async def _transmit(self, frame: frames.OutFrame, *, flush: bool = False) -> None:
        await self._out.transmit(frame, flush=flush)

    async def _send_close(self, frame: bytes) -> None:
        """Send the CLOSE frame behind the frames already queued (a goodbye sent just before
        `close()` must not be overtaken by it), and wait until it is on the socket. A link that
        drops it (an emulated cut) leaves the caller's timeout to end the wait."""
        if self._nursery is None:  # not running: nothing is queued
            await self._transmit(frame, flush=True)
            return
        self._closing_frame = frame
        await self._shape.submit(frame, False)
        await self._close_sent.wait()

    async def _transmit_from_shape(self, frame: frames.OutFrame) -> None:
        try:
            if frame is self._closing_frame:
                await self._transmit(frame, flush=True)
                self._close_sent.set()
                return
            await self._transmit(frame)
        except ConnectionClosed as e:
            self._mark_closed(str(e))
            if self._cancel_scope is not None:
                self._cancel_scope.cancel()
            raise _Stop() from None

    # ---- running ------------------------------------------------------------------------

    async def run(self, on_ready: Callable[[], None] | None = None, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> str:
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
            self._inbound.close()
            self._requests.close(self.close_reason)
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

    @property
    def record_buffer_bytes(self) -> int:
        """Bytes held by the record layer's buffers, both ways (payload buffers not included)."""
        return self._out.buffer_bytes + self._in.buffer_bytes

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
        assert self._nursery is not None  # run() is dispatching
        if msg.payload is not None:
            self.payload_bytes_received += msg.payload.nbytes
        if msg.flags & frames.FLAG_RESPONSE and msg.refused:
            self._requests.refused(msg.reply_to, msg.refused)
            return
        if msg.refused:
            self._dispatcher.refuse(self._nursery, msg.msg_type, msg.msg_id, msg.refused,
                                    bool(msg.flags & frames.FLAG_REQUEST))
            return
        if msg.flags & frames.FLAG_RESPONSE:
            if msg.flags & frames.FLAG_ERROR:
                self._requests.error(msg.reply_to, msg.body)
            else:
                self._requests.reply(msg.reply_to, msg.body, msg.payload)
            return
        self._dispatcher.deliver(self._nursery, msg.msg_type, msg.msg_id, msg.body, msg.payload,
                                 bool(msg.flags & frames.FLAG_REQUEST))

    # ---- hooks for the dispatcher ---------------------------------------------------------

    async def _respond(self, msg_type: int, msg_id: int, body: object, payload: Payload | None) -> None:
        await self._send_message(msg_type, frames.FLAG_RESPONSE, self._take_id(), msg_id, body, payload, False)

    async def _respond_error(self, msg_id: int, reason: str) -> None:
        flags = frames.FLAG_RESPONSE | frames.FLAG_ERROR
        try:
            await self._send_message(0, flags, self._take_id(), msg_id, reason, None, True)
        except ConnectionClosed:
            pass

    async def _abort(self, reason: str) -> None:
        await self._close_quietly(reason)
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()


class _Stop(Exception):
    """Ends the shape's run loop once the connection can no longer send."""
