"""The training `Comm` over the peer transport: tensors between the stage workers of daemons.

    router = TensorRouter(transport)                       # once per daemon
    comm = TransportComm(transport, rules, run=run_id, router=router, config=CommConfig.default())
    await nursery.start(comm.run)                          # per epoch
    await comm.connect({peer_id: (host, port), ...}, timeout_s=30.0)
    ... worker thread: run_step(state, plan, transport.peer_id, comm, corpus) ...
    comm.close()

A tensor is one `ControlMsg.TENSOR` request: a msgpack body {run, epoch, seq, tag, dtype,
shape} and the tensor's bytes as the payload, on the transport's chunked payload path, so
gossip and control messages interleave with large transfers. Sending copies the tensor once;
receiving builds the tensor on the buffer the transport read the payload into.

Order and flow control. Messages from one peer to another are numbered (`seq`), and the
receiver admits them to its buffer strictly in that order, so delivery is FIFO per (source,
tag) however the transport's handler tasks interleave. Each neighbour's receive buffer is
bounded (from `MessageRules`: room for `buffer_factor` of its largest message, or for what it
sends in a row, capped by `max_buffer_bytes`). The receiver replies once a tensor is in its
buffer; until then its handler waits for room (at most `handler_wait_timeout_s`). A sender
keeps at most `window_messages` / `window_bytes` unacknowledged per destination, so a receiver
that does not consume stalls its senders instead of growing its memory: it holds at most its
buffer plus one window per neighbour.

Trust. A tensor is refused (error reply, logged at DEBUG with the peer) when it comes from a
peer that is not this peer's neighbour in the plan, for another run or epoch, under a tag the
plan does not use, with a dtype, shape or size the tag does not carry (all checked from the
header before the payload is touched), or with a duplicate or out-of-window sequence number. A
malformed body is a `ProtocolError`, which closes that connection.

Failure. When the connection to a peer closes with no replacement, or the owner calls
`fail(peer, reason)`, everything waiting on that peer raises `CommError` at once, naming it;
`abort(reason)` wakes every waiter with `CommClosed`.

Threads. Workers call `isend`/`recv` from their threads; the trio side is reached through the
`TrioToken` captured when the comm is created (it must be created inside trio), and thread-side
waits use `threading` primitives with timeouts.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import trio

from dtfm.net import (
    ConnectionClosed,
    PeerConnection,
    PeerTransport,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    get_bytes,
    get_dict,
    get_int,
    get_list,
    get_str,
    short_id,
)
from dtfm.train import (
    TORCH_DTYPES,
    CommClosed,
    CommError,
    CommTimeout,
    EventHandle,
    MessageRules,
    tensor_from_wire,
    tensor_to_wire,
)

from .messages import ControlMsg

__all__ = ["CommConfig", "TensorRouter", "TransportComm"]

logger = logging.getLogger(__name__)

MiB = 1 << 20
# What a buffered tensor costs beyond its bytes (tensor object, header, queue entry); it also
# bounds how many empty tensors a buffer can hold.
ENTRY_OVERHEAD_BYTES = 1024
MAX_RUN_BYTES = 32
MAX_TAG_FIELD_CHARS = 256
_MAX_INT = 2**63 - 1
_FIELDS = frozenset({"run", "epoch", "seq", "tag", "dtype", "shape"})
_ACCEPTED = {"ok": True}


@dataclass(frozen=True)
class CommConfig:
    """Flow control of tensor traffic. Every peer of a swarm uses the same values."""

    # Unacknowledged bytes a sender keeps in flight to one peer (but never less than two of the
    # tensor being sent): more keeps a long, fast link full (bandwidth x round trip); less bounds
    # what a receiver holds in handlers waiting for room.
    window_bytes: int = 64 * MiB
    # Unacknowledged tensors to one peer. The transport allows 16 payloads in flight and 64
    # handlers per connection, shared with gossip and control: stay well under both.
    window_messages: int = 8
    # A neighbour's receive buffer holds this many of its largest message (or what it sends in a
    # row, if more): above 1 the next tensor lands while the worker computes on this one.
    buffer_factor: float = 2.0
    # Cap on one neighbour's receive buffer (never below its largest message): bounds memory
    # when a neighbour sends much in a row (a ring all-reduce step of a large model).
    max_buffer_bytes: int = 1024 * MiB
    # Tensors `isend` may queue for one peer; beyond it the send fails (a stuck peer, or a bug).
    max_queued_messages: int = 1 << 16
    # A sent tensor not acknowledged within this long fails (transfer and wait for room included).
    ack_timeout_s: float = 300.0
    # How long a receiving handler waits for room in the buffer (or for earlier sequence
    # numbers) before it refuses the tensor; a worker slower than this fails the step.
    handler_wait_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.window_bytes < 1 or not 1 <= self.window_messages <= 12:
            raise ValueError("window_bytes must be >= 1 and window_messages in 1..12")
        if not self.buffer_factor >= 1.0:
            raise ValueError("buffer_factor must be >= 1")
        if self.max_buffer_bytes < 1 or self.max_queued_messages < 1:
            raise ValueError("max_buffer_bytes and max_queued_messages must be >= 1")
        if not self.handler_wait_timeout_s > 0 or not self.ack_timeout_s > self.handler_wait_timeout_s:
            raise ValueError("need 0 < handler_wait_timeout_s < ack_timeout_s")

    @classmethod
    def default(cls) -> CommConfig:
        return cls()

    @classmethod
    def test(cls) -> CommConfig:
        """Small windows and short timeouts, so back-pressure and failures show within seconds."""
        return cls(window_bytes=8 * MiB, window_messages=4, max_buffer_bytes=64 * MiB, max_queued_messages=4096,
                   ack_timeout_s=10.0, handler_wait_timeout_s=5.0)

    def buffer_limit(self, rules: MessageRules, src: bytes) -> int:
        """Bytes (with per-entry overhead) buffered at most for tensors from `src`."""
        largest = rules.max_message_bytes(src) + ENTRY_OVERHEAD_BYTES
        msgs, nbytes = rules.burst(src)
        want = max(math.ceil(self.buffer_factor * largest), nbytes + msgs * ENTRY_OVERHEAD_BYTES)
        return max(largest, min(want, self.max_buffer_bytes))


def _name(peer: object) -> str:
    return short_id(peer) if isinstance(peer, bytes) else repr(peer)


def _nbytes(expected: tuple[str, tuple[int, ...]]) -> int:
    return TORCH_DTYPES[expected[0]].itemsize * math.prod(expected[1])


@dataclass(frozen=True)
class _Tensor:
    """A TENSOR request's body, with every field checked."""

    run: bytes
    epoch: int
    seq: int
    tag: str
    header: dict

    @classmethod
    def from_wire(cls, body: object) -> _Tensor:
        d = get_dict(body, "tensor message")
        if set(d) != _FIELDS:
            raise ProtocolError(f"tensor message fields {sorted(map(str, d))}, expected {sorted(_FIELDS)}")
        get_str(d, "dtype", 16)
        get_list(d, "shape", 8)
        return cls(get_bytes(d, "run", 1, MAX_RUN_BYTES), get_int(d, "epoch", 0, _MAX_INT),
                   get_int(d, "seq", 0, _MAX_INT), get_str(d, "tag", MAX_TAG_FIELD_CHARS), d)


class _Inbox:
    """Tensors from one neighbour waiting for the worker, admitted in sequence order."""

    def __init__(self, peer: bytes, limit_bytes: int):
        self.peer, self.name, self.limit_bytes = peer, _name(peer), limit_bytes
        self.cv = threading.Condition()  # guards everything below but `changed`
        self.queues: dict[str, deque] = {}
        self.buffered_bytes = self.peak_bytes = 0
        self.next_seq = 0
        self.claimed: set[int] = set()  # sequence numbers a handler is working on
        self.failed: str | None = None
        self.changed = trio.Event()  # trio side: set (and renewed) when a waiting handler may proceed

    def poke(self) -> None:
        """Wake the handlers waiting on this inbox (trio thread only)."""
        event, self.changed = self.changed, trio.Event()
        event.set()


class _SendBuffers:
    """Byte buffers of sent tensors, reused for later copies of the same size: a fresh large
    allocation costs a page fault per page, about as much again as the copy into it."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self._bytes = max_bytes, 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._bytes -= nbytes
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        """Take `buf` back once the transport has read it."""
        with self._lock:
            if self._bytes + buf.numel() <= self.max_bytes:
                self._free.setdefault(buf.numel(), []).append(buf)
                self._bytes += buf.numel()


@dataclass(eq=False)
class _Outgoing:
    tag: str
    body: dict
    payload: memoryview
    handle: EventHandle
    buffer: torch.Tensor | None = None  # the payload's memory when it came from _SendBuffers
    finished: bool = False

    def finish(self, error: BaseException | None) -> None:
        if not self.finished:
            self.finished = True
            self.payload = memoryview(b"")  # the bytes are on the wire or useless now
            if error is None:
                self.handle.done()
            else:
                self.handle.fail(error)


class _Outbox:
    """Tensors for one destination: a FIFO queue and a window of unacknowledged ones (trio side)."""

    def __init__(self, peer: bytes, capacity: int):
        self.peer, self.name = peer, _name(peer)
        self.send_ch, self.recv_ch = trio.open_memory_channel(capacity)
        self.inflight: set[_Outgoing] = set()
        self.unacked_bytes = self.peak_unacked_messages = 0
        self.held = 0  # taken from the queue, waiting for room in the window (0 or 1)
        self.error: CommError | None = None
        self.room = trio.Event()

    def poke(self) -> None:
        event, self.room = self.room, trio.Event()
        event.set()

    def fail(self, error: CommError) -> None:
        """Fail every tensor queued or in flight, and every later one: the stream is broken."""
        if self.error is None:
            self.error = error
        for item in list(self.inflight):
            item.finish(self.error)
        while True:
            try:
                self.recv_ch.receive_nowait().finish(self.error)
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        self.poke()


class TensorRouter:
    """Owns the transport's TENSOR handler (registered once per daemon) and routes tensors and
    connection events to the attached `TransportComm`; refuses tensors while none is."""

    def __init__(self, transport: PeerTransport):
        self.transport = transport
        self._comm: TransportComm | None = None
        transport.handle(ControlMsg.TENSOR, self._handle)
        transport.on_connect(self._on_connect)
        transport.on_disconnect(self._on_disconnect)

    def attach(self, comm: TransportComm) -> None:
        if self._comm is not None:
            raise RuntimeError("another TransportComm is running on this transport: close it first")
        self._comm = comm

    def detach(self, comm: TransportComm) -> None:
        if self._comm is comm:
            self._comm = None

    async def _handle(self, conn: PeerConnection, msg_type: int, body: object, payload: memoryview | None) -> object:
        msg = _Tensor.from_wire(body)
        if self._comm is None:
            return _refuse(conn.short_id, msg.tag, "no training run in progress")
        return await self._comm._receive(conn.peer_id, msg, payload)

    def _on_connect(self, conn: PeerConnection) -> None:
        if self._comm is not None:
            self._comm._on_connect(conn.peer_id)

    def _on_disconnect(self, conn: PeerConnection, reason: str) -> None:
        if self._comm is not None and self.transport.connection(conn.peer_id) is None:
            self._comm._on_lost(conn.peer_id, reason)


def _refuse(name: str, tag: str, why: str, duplicate: bool = False) -> dict:
    logger.debug("refused tensor %r from %s: %s", tag[:MAX_TAG_FIELD_CHARS], name, why)
    return {"ok": False, "why": why[:200], "dup": duplicate}


class TransportComm:
    """`dtfm.train.Comm` between daemons over the peer transport, for one run and epoch."""

    def __init__(self, transport: PeerTransport, rules: MessageRules, *, run: bytes, router: TensorRouter,
                 config: CommConfig = CommConfig()):
        if rules.me != transport.peer_id:
            raise ValueError("the rules are for another peer than this transport's")
        if router.transport is not transport:
            raise ValueError("the router belongs to another transport")
        if not 1 <= len(run) <= MAX_RUN_BYTES:
            raise ValueError(f"the run id is 1..{MAX_RUN_BYTES} bytes")
        self.me = transport.peer_id
        self.rules, self.config, self.run_id = rules, config, bytes(run)
        self._transport, self._router = transport, router
        self._token = trio.lowlevel.current_trio_token()  # raises outside trio: create it inside
        self._trio_thread = threading.get_ident()
        self._inboxes = {p: _Inbox(p, config.buffer_limit(rules, p)) for p in rules.neighbours}
        self._outboxes: dict[bytes, _Outbox] = {}
        self._lost: dict[bytes, str] = {}  # trio side: peers failed, and why
        self._buffers = _SendBuffers(config.window_bytes)
        self._send_lock = threading.Lock()  # orders sequence numbers with the queueing of their tensors
        self._next_seq: dict[bytes, int] = {}
        self._closed: str | None = None
        self._stop = trio.Event()
        self._connected: dict[bytes, trio.Event] = {}
        self._watching = False  # whether a lost connection fails its peer (from `connect` on)
        self._nursery: trio.Nursery | None = None

    # ---- the worker's side (any thread) ------------------------------------------------

    def isend(self, peer: bytes, tag: str, tensor: torch.Tensor) -> EventHandle:
        """Queue `tensor` (copied now) for `peer`; the handle completes when `peer` has buffered it."""
        if self._closed is not None:
            raise CommClosed(f"communicator closed: {self._closed}")
        header, view = tensor_to_wire(tensor)
        buffer = None
        if tensor.device.type == "cpu" and view.nbytes and _address(view) == tensor.data_ptr():
            buffer = self._buffers.take(view.nbytes)  # the one copy: the view aliased the caller's tensor
            buffer.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
            view = memoryview(buffer.numpy())
        handle = EventHandle(f"send {tag!r} to {_name(peer)}")
        with self._send_lock:
            seq = self._next_seq.get(peer, 0)
            self._next_seq[peer] = seq + 1
            body = {"run": self.run_id, "epoch": self.rules.epoch, "seq": seq, "tag": tag, **header}
            item = _Outgoing(tag, body, view, handle, buffer)
            try:  # FIFO: the trio side queues tensors in the order of their sequence numbers
                self._token.run_sync_soon(self._enqueue, peer, item)
            except trio.RunFinishedError:
                raise CommClosed("communicator closed: its event loop has ended") from None
        return handle

    def recv(self, peer: bytes, tag: str, timeout_s: float) -> torch.Tensor:
        """The next tensor `peer` sent under `tag`; CommError at once if `peer` fails."""
        inbox = self._inboxes.get(peer)
        if inbox is None or self.rules.expect(peer, tag) is None:
            raise CommError(f"the plan has no message {tag!r} from {_name(peer)} to this peer")
        deadline = time.monotonic() + timeout_s
        with inbox.cv:
            while True:
                queue = inbox.queues.get(tag)
                if queue:
                    tensor, cost = queue.popleft()
                    if not queue:
                        del inbox.queues[tag]
                    inbox.buffered_bytes -= cost
                    break
                if self._closed is not None:
                    raise CommClosed(f"communicator closed while waiting for {tag!r} from {inbox.name}: "
                                     f"{self._closed}")
                if inbox.failed is not None:
                    raise CommError(f"peer {inbox.name} failed while this peer waited for {tag!r}: {inbox.failed}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"nothing under {tag!r} from {inbox.name} within {timeout_s} s")
                inbox.cv.wait(left)
        self._in_trio(inbox.poke)  # room for the handlers waiting on this buffer
        return tensor

    def fail(self, peer: bytes, reason: str) -> None:
        """Give up on `peer` (e.g. gossip declared it dead): its waiters raise CommError now."""
        inbox = self._inboxes.get(peer)
        if inbox is not None:
            with inbox.cv:
                if inbox.failed is None:
                    inbox.failed = reason
                inbox.cv.notify_all()
        self._in_trio(self._fail_outbox, peer, reason)

    def abort(self, reason: str) -> None:
        """Stop: every wait, send and handler of this comm ends with CommClosed."""
        if self._closed is None:
            self._closed = reason
        for inbox in self._inboxes.values():
            with inbox.cv:
                inbox.cv.notify_all()
        self._in_trio(self._stop.set)

    def close(self) -> None:
        self.abort("closed")

    def stats(self, peer: bytes) -> dict[str, int]:
        """Buffer and window figures for `peer` (a snapshot; for status and tests)."""
        out = {"buffered_bytes": 0, "peak_buffered_bytes": 0, "buffer_limit_bytes": 0, "unacked_messages": 0,
               "peak_unacked_messages": 0, "unacked_bytes": 0, "queued_messages": 0}
        inbox = self._inboxes.get(peer)
        if inbox is not None:
            with inbox.cv:
                out.update(buffered_bytes=inbox.buffered_bytes, peak_buffered_bytes=inbox.peak_bytes,
                           buffer_limit_bytes=inbox.limit_bytes)
        box = self._outboxes.get(peer)
        if box is not None:
            queued = box.recv_ch.statistics().current_buffer_used + box.held
            out.update(unacked_messages=len(box.inflight), peak_unacked_messages=box.peak_unacked_messages,
                       unacked_bytes=box.unacked_bytes, queued_messages=queued)
        return out

    def _in_trio(self, fn, *args) -> None:
        if threading.get_ident() == self._trio_thread:
            fn(*args)
            return
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    # ---- running (trio) ------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Receive through the router and run the senders, until `close()` or cancellation."""
        self._router.attach(self)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await self._stop.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._nursery = None
            self._router.detach(self)
            self.abort(self._closed or "stopped")
            for box in self._outboxes.values():
                box.fail(CommClosed(f"communicator closed: {self._closed}"))
            for inbox in self._inboxes.values():
                inbox.poke()

    async def connect(self, addresses: Mapping[bytes, tuple[str, int]], timeout_s: float) -> None:
        """Open connections to the peers this peer exchanges tensors with (`rules.peers`).

        Of each pair, the peer with the smaller id dials and the other waits for it (half the
        time, then dials too), so the two seldom race to replace each other's connection.
        Raises CommError naming the peers that could not be reached within `timeout_s`."""
        if self._nursery is None:
            raise RuntimeError("TransportComm.run() must be running to connect")
        self._watching = True
        errors: list[str] = []
        with trio.move_on_after(timeout_s):
            async with trio.open_nursery() as nursery:
                for peer, (host, port) in addresses.items():
                    if peer != self.me:
                        nursery.start_soon(self._connect_one, peer, host, port, timeout_s / 2, errors)
        missing = [_name(p) for p in addresses if p != self.me and self._transport.connection(p) is None]
        if errors or missing:
            raise CommError(f"no connection within {timeout_s} s to {', '.join(missing) or 'every peer'}"
                            + (f": {'; '.join(errors)}" if errors else ""))

    async def _connect_one(self, peer: bytes, host: str, port: int, patience_s: float, errors: list[str]) -> None:
        if self._transport.connection(peer) is not None:
            return
        if self.me > peer:  # the smaller id dials
            with trio.move_on_after(patience_s):
                await self._connected.setdefault(peer, trio.Event()).wait()
                return
            if self._transport.connection(peer) is not None:
                return
        try:
            conn = await self._transport.connect(host, port, peer_id=peer)
        except (OSError, TimeoutError, ProtocolError, ConnectionClosed) as e:
            errors.append(f"{_name(peer)} at {host}:{port}: {e}")
            return
        if conn.peer_id != peer:
            errors.append(f"{host}:{port} is peer {conn.short_id}, not {_name(peer)}")

    def _on_connect(self, peer: bytes) -> None:
        event = self._connected.pop(peer, None)
        if event is not None:
            event.set()

    def _on_lost(self, peer: bytes, reason: str) -> None:
        if self._watching:  # before `connect`, a lost connection is simply dialled again
            self.fail(peer, f"connection lost ({reason})")

    # ---- sending (trio) ------------------------------------------------------------------

    def _enqueue(self, peer: bytes, item: _Outgoing) -> None:
        if self._closed is not None or self._nursery is None:
            item.finish(CommClosed(f"communicator not running: cannot send {item.tag!r} to {_name(peer)}"))
            return
        box = self._outboxes.get(peer)
        if box is None:
            box = self._outboxes[peer] = _Outbox(peer, self.config.max_queued_messages)
            if peer in self._lost:
                box.fail(CommError(f"peer {box.name} failed: {self._lost[peer]}"))
            self._nursery.start_soon(self._send_loop, box)
        if box.error is not None:
            item.finish(box.error)
            return
        try:
            box.send_ch.send_nowait(item)
        except trio.WouldBlock:
            item.finish(CommError(f"more than {self.config.max_queued_messages} tensors queued for {box.name}"))
            box.fail(CommError(f"send queue to {box.name} overflowed"))

    def _fail_outbox(self, peer: bytes, reason: str) -> None:
        self._lost.setdefault(peer, reason)
        box = self._outboxes.get(peer)
        if box is not None:
            box.fail(CommError(f"peer {box.name} failed: {reason}"))
        inbox = self._inboxes.get(peer)
        if inbox is not None:
            inbox.poke()

    async def _send_loop(self, box: _Outbox) -> None:
        cfg = self.config
        async for item in box.recv_ch:
            size = item.payload.nbytes
            box.held = 1
            try:
                # at least two of this size in flight, so the link does not idle during an ack
                window_bytes = max(cfg.window_bytes, 2 * size)
                while box.error is None and box.inflight and (
                        len(box.inflight) >= cfg.window_messages or box.unacked_bytes + size > window_bytes):
                    await box.room.wait()
            except BaseException:
                item.finish(CommClosed(f"communicator closed before {item.tag!r} went to {box.name}"))
                raise
            finally:
                box.held = 0
            if box.error is not None:
                item.finish(box.error)
                continue
            box.inflight.add(item)
            box.unacked_bytes += size
            box.peak_unacked_messages = max(box.peak_unacked_messages, len(box.inflight))
            self._nursery.start_soon(self._deliver, box, item, size)

    async def _deliver(self, box: _Outbox, item: _Outgoing, size: int) -> None:
        error: CommError | None = CommClosed(f"communicator closed while sending {item.tag!r} to {box.name}")
        try:
            error = await self._request(box, item)
        finally:
            box.inflight.discard(item)
            box.unacked_bytes -= size
            item.finish(error)
            if error is not None:  # a later tensor would wait for this one's sequence number forever
                box.fail(CommError(f"stream to {box.name} broken at {item.tag!r}: {error}"))
            box.poke()
            if item.buffer is not None:  # the request is over: the transport has let go of the bytes
                self._buffers.give(item.buffer)

    async def _request(self, box: _Outbox, item: _Outgoing) -> CommError | None:
        """Send one tensor and wait for its acknowledgement; the error, or None."""
        conn = self._transport.connection(box.peer)
        deadline = trio.current_time() + self.config.ack_timeout_s
        resent = False
        while True:
            if box.error is not None:
                return box.error
            if conn is None:
                return CommError(f"no connection to {box.name}")
            try:
                reply, _ = await conn.request(ControlMsg.TENSOR, item.body, payload=item.payload,
                                              timeout_s=max(deadline - trio.current_time(), 1e-3))
            except ConnectionClosed as e:
                new = self._transport.connection(box.peer)
                if new is None or new is conn:
                    return CommError(f"connection to {box.name} lost: {e}")
                conn, resent = new, True  # replaced (both ends dialled): the receiver drops a duplicate
                continue
            except RequestTimeout:
                return CommTimeout(f"{box.name} did not acknowledge {item.tag!r} within {self.config.ack_timeout_s} s")
            except (RemoteError, ValueError) as e:
                return CommError(f"{box.name} did not take {item.tag!r}: {e}")
            return _verdict(reply, box.name, item.tag, resent)

    # ---- receiving (trio, from the router) ------------------------------------------------

    async def _receive(self, src: bytes, msg: _Tensor, payload: memoryview | None) -> dict:
        name = _name(src)
        if self._closed is not None:
            return _refuse(name, msg.tag, "communicator closed")
        if msg.run != self.run_id or msg.epoch != self.rules.epoch:
            return _refuse(name, msg.tag, f"run {msg.run.hex()[:8]} epoch {msg.epoch}, this peer is in "
                                          f"run {self.run_id.hex()[:8]} epoch {self.rules.epoch}")
        inbox = self._inboxes.get(src)
        if inbox is None:
            return _refuse(name, msg.tag, f"not a neighbour of this peer in epoch {self.rules.epoch}")
        expected = self.rules.expect(src, msg.tag)
        if expected is None:
            return _refuse(name, msg.tag, "not a tag this peer sends here under the plan")
        dtype, shape = msg.header["dtype"], msg.header["shape"]
        if dtype != expected[0]:
            return _refuse(name, msg.tag, f"dtype {dtype!r}, the tag carries {expected[0]}")
        if tuple(shape) != expected[1] or any(type(s) is not int for s in shape):
            return _refuse(name, msg.tag, f"shape {shape!r}, the tag carries {list(expected[1])}")
        nbytes = _nbytes(expected)
        if payload is None and nbytes == 0:
            payload = memoryview(b"")  # an empty payload travels as none
        try:
            tensor = tensor_from_wire(msg.header, payload, max_bytes=nbytes)
        except ProtocolError as e:
            return _refuse(name, msg.tag, str(e))
        return await self._admit(inbox, msg, tensor, nbytes + ENTRY_OVERHEAD_BYTES)

    async def _admit(self, inbox: _Inbox, msg: _Tensor, tensor: torch.Tensor, cost: int) -> dict:
        """Wait for `msg.seq`'s turn and room in the buffer, then buffer the tensor."""
        deadline = trio.current_time() + self.config.handler_wait_timeout_s
        window, seq, mine = self.config.window_messages, msg.seq, False
        try:
            while True:
                with inbox.cv:
                    if self._closed is not None or inbox.failed is not None:
                        return _refuse(inbox.name, msg.tag, f"no longer receiving: {self._closed or inbox.failed}")
                    if seq < inbox.next_seq:
                        return _refuse(inbox.name, msg.tag, f"duplicate sequence number {seq}", duplicate=True)
                    if seq >= inbox.next_seq + window:
                        return _refuse(inbox.name, msg.tag, f"sequence number {seq} outside the window "
                                                            f"[{inbox.next_seq}, {inbox.next_seq + window})")
                    if not mine and seq not in inbox.claimed:
                        inbox.claimed.add(seq)
                        mine = True
                    if mine and seq == inbox.next_seq and (
                            inbox.buffered_bytes == 0 or inbox.buffered_bytes + cost <= inbox.limit_bytes):
                        inbox.queues.setdefault(msg.tag, deque()).append((tensor, cost))
                        inbox.buffered_bytes += cost
                        inbox.peak_bytes = max(inbox.peak_bytes, inbox.buffered_bytes)
                        inbox.next_seq += 1
                        inbox.cv.notify_all()
                        return _ACCEPTED
                    changed, waiting_for = inbox.changed, inbox.next_seq
                with trio.move_on_at(deadline) as scope:
                    await changed.wait()
                if scope.cancelled_caught:
                    why = "no room in the buffer" if seq == waiting_for else f"sequence number {waiting_for} never came"
                    return _refuse(inbox.name, msg.tag, f"{why} within {self.config.handler_wait_timeout_s} s")
        finally:
            if mine:
                with inbox.cv:
                    inbox.claimed.discard(seq)
            inbox.poke()


def _verdict(reply: object, name: str, tag: str, resent: bool) -> CommError | None:
    """The receiver's answer to one tensor: None when it has it, else the error."""
    if type(reply) is not dict or type(reply.get("ok")) is not bool:
        return CommError(f"{name} answered {tag!r} with a malformed reply")
    if reply["ok"] or (resent and reply.get("dup") is True):
        return None
    why = reply.get("why")
    return CommError(f"{name} refused {tag!r}: {why if isinstance(why, str) else 'no reason given'}")


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data
