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

Modules. `TransportComm` and its router are here, with the worker's side (`isend`, `recv`) and
the connections; its trio-side sending is `CommSender` (control/comm_send.py: queues, windows,
acknowledgements), its receiving `CommReceiver` (control/comm_receive.py: checks, buffers),
both mixed in; the TENSOR message and its replies are in control/comm_wire.py.

Threads. Workers call `isend`/`recv` from their threads; the trio side is reached through the
`TrioToken` captured when the comm is created (it must be created inside trio), and thread-side
waits use `threading` primitives with timeouts.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import trio

from dtfm.net import ConnectionClosed, PeerConnection, PeerTransport, ProtocolError
from dtfm.train import CommClosed, CommError, CommTimeout, EventHandle, MessageRules, tensor_to_wire

from .comm_receive import ENTRY_OVERHEAD_BYTES, CommReceiver, _Inbox
from .comm_send import CommSender, _Outbox, _Outgoing, _SendBuffers
from .comm_wire import MAX_RUN_BYTES, _address, _name, _refuse, _Tensor
from .messages import ControlMsg

__all__ = ["CommConfig", "TensorRouter", "TransportComm"]

MiB = 1 << 20


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


class TransportComm(CommSender, CommReceiver):
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
