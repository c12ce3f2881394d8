"""Message handling shared by every connection type (TCP `Connection`, in-memory
`MemConnection`), so both keep the contract in `interface` the same way:

- `check_handler`: which message types a transport lets a handler register;
- `encode_body`: the limits every outgoing message is checked against;
- `Requests`: this end's requests waiting for replies (timeouts, late replies, closing);
- `Dispatcher`: runs handlers for incoming messages, at most `max_concurrent_handlers` at a
  time, and turns their outcome into a reply, an error reply or a closed connection;
- `Refusals`: how many incoming messages each transport refused, by reason and message type.
  No input ends a service: a handler's exception refuses that one message, counted here.

A connection that uses a `Dispatcher` provides three hooks (`Answering`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Generic, Protocol, TypeVar

import trio

from .config import TransportConfig
from .errors import ConnectionClosed, ProtocolError, RemoteError, RequestTimeout
from .frames import MSG_HEADER_BYTES
from .interface import Handler, Payload, PeerConnection, Reply
from .wire import MAX_MSG_TYPE, pack

logger = logging.getLogger(__name__)

# Message types 0-3 belong to the transport itself; the daemon uses 4-31.
PING = 0  # request with an empty body, answered by the transport
KEEPALIVE = 1  # one-way, ignored; keeps an idle connection from timing out


def check_handler(handlers: Mapping[int, Handler], msg_type: int) -> None:
    """Raise ValueError unless a handler may be registered for msg_type."""
    if msg_type in (PING, KEEPALIVE) or not 0 <= msg_type <= MAX_MSG_TYPE:
        raise ValueError(f"message type {msg_type} is reserved or out of range")
    if msg_type in handlers:
        raise ValueError(f"message type {msg_type} already has a handler")


class Refusals:
    """Counts of refused incoming messages by (reason, message type). Bounded: reasons are the
    fixed names below and message types are at most MAX_MSG_TYPE + 1."""

    MALFORMED = "malformed"  # the handler raised ProtocolError: the connection was closed
    FAILED = "failed"  # the handler crashed on it (a bug, logged with its traceback)
    BUSY = "busy"  # too many handlers in progress for that connection
    UNKNOWN = "unknown"  # no handler for its type

    def __init__(self) -> None:
        self._counts: dict[tuple[str, int], int] = {}

    def count(self, reason: str, msg_type: int) -> None:
        key = (reason, msg_type)
        self._counts[key] = self._counts.get(key, 0) + 1

    def get(self, reason: str, msg_type: int) -> int:
        return self._counts.get((reason, msg_type), 0)

    def total(self) -> int:
        return sum(self._counts.values())

    def to_wire(self) -> dict[str, int]:
        """`{"malformed/70": 3, ...}`, sorted: the daemon's status shows it."""
        return {f"{r}/{t}": n for (r, t), n in sorted(self._counts.items())}


C = TypeVar("C", bound=PeerConnection)


class Registry(Generic[C]):
    """What both transports keep the same way: handlers by message type, connect and disconnect
    callbacks, the live connection to each peer (`_by_peer`, kept by the subclass) and the
    count of refused input."""

    def __init__(self) -> None:
        self.refusals = Refusals()
        self._handlers: dict[int, Handler] = {}
        self._on_connect: list[Callable[[PeerConnection], None]] = []
        self._on_disconnect: list[Callable[[PeerConnection, str], None]] = []
        self._by_peer: dict[bytes, C] = {}

    def handle(self, msg_type: int, handler: Handler) -> None:
        check_handler(self._handlers, msg_type)
        self._handlers[msg_type] = handler

    def on_connect(self, cb: Callable[[PeerConnection], None]) -> None:
        self._on_connect.append(cb)

    def on_disconnect(self, cb: Callable[[PeerConnection, str], None]) -> None:
        self._on_disconnect.append(cb)

    def connection(self, peer_id: bytes) -> C | None:
        conn = self._by_peer.get(peer_id)
        return conn if conn is not None and not conn.closed else None

    def connections(self) -> list[C]:
        return [c for c in self._by_peer.values() if not c.closed]


def encode_body(msg_type: int, body: object, payload_len: int, config: TransportConfig) -> bytes:
    """The msgpack body of an outgoing message; ValueError when it breaks a limit."""
    if not 0 <= msg_type <= MAX_MSG_TYPE:
        raise ValueError(f"message type {msg_type} out of range")
    encoded = pack(body)
    if payload_len > config.max_payload_bytes:
        raise ValueError(f"payload of {payload_len} bytes exceeds max_payload_bytes")
    if MSG_HEADER_BYTES + len(encoded) > config.max_control_frame_bytes:
        raise ValueError(f"message body of {len(encoded)} bytes exceeds max_control_frame_bytes")
    return encoded


class _Pending:
    __slots__ = ("error", "event", "result")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.result: tuple[object, memoryview | None] | None = None
        self.error: BaseException | None = None


class _IdleWait:
    """Waiters for the moment an owner's work in flight ends (`wake`, called when the last
    of it ended) or its connection closed (`close`)."""

    def __init__(self) -> None:
        self._lot = trio.lowlevel.ParkingLot()
        self.closed = False

    def wake(self) -> None:
        self._lot.unpark_all()

    def close(self) -> None:
        self.closed = True
        self._lot.unpark_all()

    async def wait(self, busy: Callable[[], bool]) -> None:
        """Until `busy()` is false or the connection closed."""
        while busy() and not self.closed:
            await self._lot.park()


class Requests:
    """Requests of one connection that wait for their replies, by message id."""

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self._pending: dict[int, _Pending] = {}
        self._idle = _IdleWait()  # woken when the last request got its answer

    async def call(self, conn: PeerConnection, msg_id: int, msg_type: int, send: Callable[[], Awaitable[None]],
                   timeout_s: float) -> tuple[object, memoryview | None]:
        """Run `send()` and wait for the reply to msg_id, all within timeout_s."""
        pending = self._pending[msg_id] = _Pending()
        try:
            with trio.move_on_after(timeout_s):
                await send()
                await pending.event.wait()
        finally:
            self._pending.pop(msg_id, None)
            if not self._pending:
                self._idle.wake()
        if pending.error is not None:
            raise pending.error
        if pending.result is None:
            if conn.closed:
                raise ConnectionClosed(conn.close_reason)
            raise RequestTimeout(f"no reply from {self._peer} to message type {msg_type} within {timeout_s} s")
        return pending.result

    def busy(self) -> bool:
        """Some request still waits for its reply."""
        return bool(self._pending)

    async def wait_idle(self) -> None:
        """Until no request waits for its reply, or the connection closed."""
        await self._idle.wait(self.busy)

    def reply(self, reply_to: int, body: object, payload: memoryview | None) -> None:
        p = self._take(reply_to)
        if p is not None:
            p.result = (body, payload)
            p.event.set()

    def error(self, reply_to: int, reason: object) -> None:
        p = self._take(reply_to)
        if p is not None:
            p.error = RemoteError(f"{self._peer}: {str(reason)[:200]}")
            p.event.set()

    def refused(self, reply_to: int, reason: str) -> None:
        """The reply to reply_to came with a payload this end refused (its payload budget)."""
        p = self._take(reply_to)
        if p is not None:
            logger.warning("reply from %s dropped: %s", self._peer, reason)
            p.error = RemoteError(f"reply from {self._peer} not received: {reason}")
            p.event.set()

    def close(self, reason: str) -> None:
        """The connection closed: every waiting request raises ConnectionClosed(reason)."""
        for p in self._pending.values():
            if not p.event.is_set():
                p.error = ConnectionClosed(reason)
                p.event.set()
        self._idle.close()

    def _take(self, reply_to: int) -> _Pending | None:
        p = self._pending.get(reply_to)
        if p is None or p.event.is_set():
            logger.debug("late or unknown reply %d from %s", reply_to, self._peer)
            return None
        return p


class Answering(PeerConnection, Protocol):
    """What a `Dispatcher` needs from its connection besides the public interface."""

    async def _respond(self, msg_type: int, msg_id: int, body: object, payload: Payload | None) -> None:
        """Send a reply; ConnectionClosed, or ValueError when it breaks a limit."""

    async def _respond_error(self, msg_id: int, reason: str) -> None:
        """Send an error reply, best effort (never raises ConnectionClosed)."""

    async def _abort(self, reason: str) -> None:
        """Close the connection after bad input (a handler's ProtocolError)."""


class Dispatcher:
    """Runs the handlers for one connection's incoming requests and one-way messages."""

    def __init__(self, conn: Answering, handlers: Mapping[int, Handler], max_concurrent: int,
                 refusals: Refusals | None = None) -> None:
        self._conn = conn
        self._handlers = handlers
        self._refusals = refusals if refusals is not None else Refusals()
        self._slots = max_concurrent
        self._running: set[trio.CancelScope] = set()
        self._idle = _IdleWait()  # woken when the last running handler ended

    def deliver(self, nursery: trio.Nursery, msg_type: int, msg_id: int, body: object,
                payload: memoryview | None, is_request: bool) -> None:
        """Start the handler for a message in `nursery`, or answer why not."""
        peer = self._conn.short_id
        if msg_type == KEEPALIVE and not is_request:
            return
        handler = _ping_handler if msg_type == PING else self._handlers.get(msg_type)
        if handler is None:
            logger.debug("no handler for message type %d from %s", msg_type, peer)
            self._refusals.count(Refusals.UNKNOWN, msg_type)
            if is_request:
                nursery.start_soon(self._conn._respond_error, msg_id, f"unknown message type {msg_type}")
            return
        if self._slots <= 0:
            logger.warning("too many requests in progress from %s: dropped message type %d", peer, msg_type)
            self._refusals.count(Refusals.BUSY, msg_type)
            if is_request:
                nursery.start_soon(self._conn._respond_error, msg_id, "busy")
            return
        self._slots -= 1
        nursery.start_soon(self._run, handler, msg_type, msg_id, body, payload, is_request)

    def refuse(self, nursery: trio.Nursery, msg_type: int, msg_id: int, reason: str, is_request: bool) -> None:
        """A message whose payload this end refused (its payload budget): not handled; a
        request is answered with the reason."""
        logger.warning("message type %d from %s dropped: %s", msg_type, self._conn.short_id, reason)
        if is_request:
            nursery.start_soon(self._conn._respond_error, msg_id, reason)

    def busy(self) -> bool:
        """Some handler still runs (its request's reply not yet sent)."""
        return bool(self._running)

    async def wait_idle(self) -> None:
        """Until no handler runs, or the connection closed."""
        await self._idle.wait(self.busy)

    def cancel(self) -> None:
        """The connection closed: stop the handlers still running."""
        for scope in self._running:
            scope.cancel()
        self._idle.close()

    async def _run(self, handler: Handler, msg_type: int, msg_id: int, body: object,
                   payload: memoryview | None, is_request: bool) -> None:
        conn, peer = self._conn, self._conn.short_id
        with trio.CancelScope() as scope:
            self._running.add(scope)
            try:
                try:
                    result = await handler(conn, msg_type, body, payload)
                except ProtocolError as e:
                    logger.debug("bad message type %d from %s: %s", msg_type, peer, e)
                    self._refusals.count(Refusals.MALFORMED, msg_type)
                    await conn._abort(f"protocol error in message type {msg_type}: {e}")
                    return
                except (ConnectionClosed, RequestTimeout, RemoteError) as e:
                    logger.debug("handler for message type %d from %s failed: %s", msg_type, peer, e)
                    if is_request:
                        await conn._respond_error(msg_id, "handler failed")
                    return
                except Exception:
                    logger.exception("handler for message type %d from %s crashed", msg_type, peer)
                    self._refusals.count(Refusals.FAILED, msg_type)
                    if is_request:
                        await conn._respond_error(msg_id, "internal error")
                    return
                if is_request:
                    await self._reply(msg_type, msg_id, result)
            finally:
                self._running.discard(scope)
                self._slots += 1
                if not self._running:
                    self._idle.wake()

    async def _reply(self, msg_type: int, msg_id: int, result: object) -> None:
        body, payload = (result.body, result.payload) if isinstance(result, Reply) else (result, None)
        try:
            await self._conn._respond(msg_type, msg_id, body, payload)
        except ConnectionClosed:
            pass
        except ValueError as e:  # the handler's reply cannot be encoded or is too large
            logger.error("reply to message type %d from %s not sent: %s", msg_type, self._conn.short_id, e)
            await self._conn._respond_error(msg_id, "reply not encodable")


async def _ping_handler(conn: PeerConnection, msg_type: int, body: object, payload: object) -> None:
    return None
