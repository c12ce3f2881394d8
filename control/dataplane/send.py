"""The sending side of the data plane: `Sender`, a queue and a window per destination.

The sender owns the sequence numbers, one `_Outbox` per destination and the reused send
buffers. `submit` (any thread) copies a tensor once, numbers it and hands it to the trio side,
which queues it for its destination (bounded by `max_queued_messages`); one task per
destination takes tensors in order and sends each once the window allows (at most
`window_messages` and `window_bytes` unacknowledged), each in its own request that waits for
the receiver's acknowledgement. A tensor that fails (refused, not acknowledged within
`ack_timeout_s`, connection lost) fails every later one to that destination: the receiver would
wait for its sequence number forever. The bytes of sent tensors are kept for reuse
(`_SendBuffers`). `TransportComm` (control/dataplane/comm.py) owns one; the protocol is in
docs/control.md.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import trio

from dtfm.net import ConnectionClosed, PeerTransport, RemoteError, RequestTimeout
from dtfm.train import CommClosed, CommError, CommTimeout, EventHandle, describe_tag, tensor_to_wire

from ..messages import ControlMsg
from .config import CommConfig
from .wire import peer_name, verdict

__all__ = ["Sender"]


def _address(view: memoryview) -> int:
    """Where `view`'s bytes are in memory (whether a payload aliases a tensor)."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


class _SendBuffers:
    """Byte buffers of sent tensors, reused for later copies of the same size, up to
    `max_bytes` of free ones: a fresh large allocation costs a page fault and a zeroed page per
    4 KiB, about four times the copy into a warm buffer, and training sends tensors of the same
    few sizes step after step."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.free_bytes = max_bytes, 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.free_bytes -= nbytes
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        """Take `buf` back once the transport has read it."""
        with self._lock:
            if self.free_bytes + buf.numel() <= self.max_bytes:
                self._free.setdefault(buf.numel(), []).append(buf)
                self.free_bytes += buf.numel()


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
        self.peer, self.name = peer, peer_name(peer)
        self.send_ch, self.recv_ch = trio.open_memory_channel[_Outgoing](capacity)
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


class Sender:
    """Tensors from this peer to the others, for one run and epoch."""

    def __init__(self, transport: PeerTransport, config: CommConfig, run_id: bytes, epoch: int,
                 token: trio.lowlevel.TrioToken):
        self._transport, self._config = transport, config
        self._run_id, self._epoch = run_id, epoch
        self._token = token  # the trio side, reached from the worker's thread
        self._buffers = _SendBuffers(config.send_pool_bytes)
        self._send_lock = threading.Lock()  # orders sequence numbers with the queueing of their tensors
        self._next_seq: dict[bytes, int] = {}
        self._closed: str | None = None  # why the comm closed; set once, from any thread
        # trio side
        self._outboxes: dict[bytes, _Outbox] = {}
        self._lost: dict[bytes, str] = {}  # peers failed, and why
        self._nursery: trio.Nursery | None = None  # where the per-destination tasks run, while sending

    # ---- the worker's side (any thread) ------------------------------------------------

    def submit(self, peer: bytes, tag: str, tensor: torch.Tensor) -> EventHandle:
        """Queue `tensor` (copied now) for `peer`; the handle completes when `peer` has buffered it."""
        if self._closed is not None:
            raise CommClosed(f"communicator closed: {self._closed}")
        header, view = tensor_to_wire(tensor)
        buffer = None
        if tensor.device.type == "cpu" and view.nbytes and _address(view) == tensor.data_ptr():
            buffer = self._buffers.take(view.nbytes)  # the one copy: the view aliased the caller's tensor
            buffer.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
            view = memoryview(buffer.numpy())  # type: ignore[arg-type]  # an ndarray is a buffer
        handle = EventHandle(f"send {tag!r} to {peer_name(peer)}")
        with self._send_lock:
            seq = self._next_seq.get(peer, 0)
            self._next_seq[peer] = seq + 1
            body = {"run": self._run_id, "epoch": self._epoch, "seq": seq, "tag": tag, **header}
            item = _Outgoing(tag, body, view, handle, buffer)
            try:  # FIFO: the trio side queues tensors in the order of their sequence numbers
                self._token.run_sync_soon(self._enqueue, peer, item)
            except trio.RunFinishedError:
                raise CommClosed("communicator closed: its event loop has ended") from None
        return handle

    def close(self, reason: str) -> None:
        """Refuse every later tensor with CommClosed (the first reason stays)."""
        if self._closed is None:
            self._closed = reason

    def stats(self, peer: bytes) -> dict[str, int]:
        """Window figures for `peer` (a snapshot; zeros before anything went to it), and the
        bytes of free send copies kept for reuse (for every destination)."""
        pool = {"send_pool_bytes": self._buffers.free_bytes}
        box = self._outboxes.get(peer)
        if box is None:
            return {"unacked_messages": 0, "peak_unacked_messages": 0, "unacked_bytes": 0, "queued_messages": 0,
                    **pool}
        queued = box.recv_ch.statistics().current_buffer_used + box.held
        return {"unacked_messages": len(box.inflight), "peak_unacked_messages": box.peak_unacked_messages,
                "unacked_bytes": box.unacked_bytes, "queued_messages": queued, **pool}

    # ---- the trio side -----------------------------------------------------------------

    def start(self, nursery: trio.Nursery) -> None:
        """Send from now on, with one task per destination in `nursery`."""
        self._nursery = nursery

    def stop(self) -> None:
        """Stop sending (after `close`): every tensor queued or in flight fails with CommClosed."""
        self._nursery = None
        for box in self._outboxes.values():
            box.fail(CommClosed(f"communicator closed: {self._closed}"))

    def fail(self, peer: bytes, reason: str) -> None:
        """Give up on `peer`: what is queued for it, in flight to it or sent later fails."""
        self._lost.setdefault(peer, reason)
        box = self._outboxes.get(peer)
        if box is not None:
            box.fail(CommError(f"peer {box.name} failed: {reason}"))

    def _enqueue(self, peer: bytes, item: _Outgoing) -> None:
        if self._closed is not None or self._nursery is None:
            item.finish(CommClosed(f"communicator not running: cannot send {describe_tag(item.tag)} to {peer_name(peer)}"))
            return
        box = self._outboxes.get(peer)
        if box is None:
            box = self._outboxes[peer] = _Outbox(peer, self._config.max_queued_messages)
            if peer in self._lost:
                box.fail(CommError(f"peer {box.name} failed: {self._lost[peer]}"))
            self._nursery.start_soon(self._send_loop, box, self._nursery)
        if box.error is not None:
            item.finish(box.error)
            return
        try:
            box.send_ch.send_nowait(item)
        except trio.WouldBlock:
            item.finish(CommError(f"more than {self._config.max_queued_messages} tensors queued for {box.name}"))
            box.fail(CommError(f"send queue to {box.name} overflowed"))

    async def _send_loop(self, box: _Outbox, nursery: trio.Nursery) -> None:
        cfg = self._config
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
                item.finish(CommClosed(f"communicator closed before {describe_tag(item.tag)} went to {box.name}"))
                raise
            finally:
                box.held = 0
            if box.error is not None:
                item.finish(box.error)
                continue
            box.inflight.add(item)
            box.unacked_bytes += size
            box.peak_unacked_messages = max(box.peak_unacked_messages, len(box.inflight))
            nursery.start_soon(self._deliver, box, item, size)

    async def _deliver(self, box: _Outbox, item: _Outgoing, size: int) -> None:
        error: CommError | None = CommClosed(f"communicator closed while sending {describe_tag(item.tag)} to {box.name}")
        try:
            error = await self._request(box, item)
        finally:
            box.inflight.discard(item)
            box.unacked_bytes -= size
            item.finish(error)
            if error is not None:  # a later tensor would wait for this one's sequence number forever
                box.fail(CommError(f"stream to {box.name} broken at {describe_tag(item.tag)}: {error}"))
            box.poke()
            if item.buffer is not None:  # the request is over: the transport has let go of the bytes
                self._buffers.give(item.buffer)

    async def _request(self, box: _Outbox, item: _Outgoing) -> CommError | None:
        """Send one tensor and wait for its acknowledgement; the error, or None."""
        conn = self._transport.connection(box.peer)
        deadline = trio.current_time() + self._config.ack_timeout_s
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
                return CommTimeout(f"{box.name} did not acknowledge {describe_tag(item.tag)} within {self._config.ack_timeout_s} s")
            except (RemoteError, ValueError) as e:
                return CommError(f"{box.name} did not take {describe_tag(item.tag)}: {e}")
            return verdict(reply, box.name, item.tag, resent)
