"""The receiving side of the data plane (control/comm.py): a bounded buffer per neighbour.

The router (`TensorRouter`) hands each TENSOR request to `_receive`, which checks it against
the plan from its header alone (see "Trust" in control/comm.py) before it builds the tensor on
the payload's buffer. `_admit` then waits for the tensor's turn (sequence numbers in order) and
for room in the neighbour's buffer (`_Inbox`), at most `handler_wait_timeout_s`, and buffers it
for the worker's `recv`; the reply goes out only then.

`CommReceiver` is mixed into `TransportComm` (control/comm.py); it uses the comm's state
through `self`.
"""

from __future__ import annotations

import threading
from collections import deque

import torch
import trio

from dtfm.train import CodecError, tensor_from_wire

from .comm_wire import _ACCEPTED, _name, _nbytes, _refuse, _Tensor

__all__ = ["ENTRY_OVERHEAD_BYTES", "CommReceiver"]

# What a buffered tensor costs beyond its bytes (tensor object, header, queue entry); it also
# bounds how many empty tensors a buffer can hold.
ENTRY_OVERHEAD_BYTES = 1024


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


class CommReceiver:
    """`TransportComm`'s receiving methods, on the trio side (a mixin: see the module docstring)."""

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
        except CodecError as e:  # untrusted bytes: refused like any other bad tensor
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
