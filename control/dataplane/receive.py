"""The receiving side of the data plane: `Receiver`, a bounded buffer per neighbour.

The receiver owns one `_Inbox` per neighbour of the plan. On the trio side, `receive` checks a
TENSOR request against the plan from its header alone (see "Trust" in control/dataplane/comm.py)
before it builds the tensor on the payload's buffer; `_admit` then waits for the tensor's turn
(sequence numbers in order) and for room in the neighbour's buffer, at most
`handler_wait_timeout_s`, and buffers it; the reply goes out only then. On the worker's side
(any thread), `take` hands out buffered tensors in order. `TransportComm`
(control/dataplane/comm.py) owns one and carries calls between the two sides; the protocol is
in docs/control.md.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

import torch
import trio

from dtfm.train import (TORCH_DTYPES, CodecError, CommClosed, CommError, CommTimeout, MessageRules, describe_tag,
                        tensor_from_wire)

from .config import ENTRY_OVERHEAD_BYTES, CommConfig
from .wire import ACCEPTED, TensorMsg, peer_name, refuse

__all__ = ["Receiver"]


def _nbytes(expected: tuple[str, tuple[int, ...]]) -> int:
    """The payload's size of a tensor of (dtype, shape)."""
    return TORCH_DTYPES[expected[0]].itemsize * math.prod(expected[1])


class _Inbox:
    """Tensors from one neighbour waiting for the worker, admitted in sequence order."""

    def __init__(self, peer: bytes, limit_bytes: int):
        self.peer, self.name, self.limit_bytes = peer, peer_name(peer), limit_bytes
        self.cv = threading.Condition()  # guards everything below but `changed`
        self.queues: dict[str, deque[tuple[torch.Tensor, int]]] = {}  # tag -> (tensor, cost) in order
        self.buffered_bytes = self.peak_bytes = 0
        self.next_seq = 0
        self.claimed: set[int] = set()  # sequence numbers a handler is working on
        self.failed: str | None = None
        self.changed = trio.Event()  # trio side: set (and renewed) when a waiting handler may proceed

    def poke(self) -> None:
        """Wake the handlers waiting on this inbox (trio thread only)."""
        event, self.changed = self.changed, trio.Event()
        event.set()


class Receiver:
    """Tensors from this peer's neighbours in the plan, for one run and epoch."""

    def __init__(self, rules: MessageRules, config: CommConfig, run_id: bytes):
        self._rules, self._config, self._run_id = rules, config, run_id
        self._inboxes = {p: _Inbox(p, config.buffer_limit(rules, p)) for p in rules.neighbours}
        self._closed: str | None = None  # why the comm closed; set once, from any thread

    # ---- the worker's side (any thread) ------------------------------------------------

    def take(self, peer: bytes, tag: str, timeout_s: float) -> torch.Tensor:
        """The next tensor `peer` sent under `tag`; CommError at once if `peer` fails. The caller
        then calls `wake(peer)` on the trio side: there is room in the buffer."""
        inbox = self._inboxes.get(peer)
        if inbox is None or self._rules.expect(peer, tag) is None:
            raise CommError(f"the plan has no message {tag!r} from {peer_name(peer)} to this peer")
        deadline = time.monotonic() + timeout_s
        with inbox.cv:
            while True:
                queue = inbox.queues.get(tag)
                if queue:
                    tensor, cost = queue.popleft()
                    if not queue:
                        del inbox.queues[tag]
                    inbox.buffered_bytes -= cost
                    return tensor
                if self._closed is not None:
                    raise CommClosed(f"communicator closed while waiting for {describe_tag(tag)} from "
                                     f"{inbox.name}: {self._closed}")
                if inbox.failed is not None:
                    raise CommError(f"peer {inbox.name} failed while this peer waited for {describe_tag(tag)}: "
                                    f"{inbox.failed}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"{describe_tag(tag)} did not come from {inbox.name} within {timeout_s} s")
                inbox.cv.wait(left)

    def fail(self, peer: bytes, reason: str) -> None:
        """Fail `peer`: waits on it raise CommError now, its handlers refuse (then `wake(peer)`)."""
        inbox = self._inboxes.get(peer)
        if inbox is not None:
            with inbox.cv:
                if inbox.failed is None:
                    inbox.failed = reason
                inbox.cv.notify_all()

    def close(self, reason: str) -> None:
        """Close: every wait raises CommClosed, every handler refuses (the first reason stays)."""
        if self._closed is None:
            self._closed = reason
        for inbox in self._inboxes.values():
            with inbox.cv:
                inbox.cv.notify_all()

    def stats(self, peer: bytes) -> dict[str, int]:
        """Buffer figures for `peer` (a snapshot; zeros for a peer that is no neighbour)."""
        inbox = self._inboxes.get(peer)
        if inbox is None:
            return {"buffered_bytes": 0, "peak_buffered_bytes": 0, "buffer_limit_bytes": 0}
        with inbox.cv:
            return {"buffered_bytes": inbox.buffered_bytes, "peak_buffered_bytes": inbox.peak_bytes,
                    "buffer_limit_bytes": inbox.limit_bytes}

    # ---- the trio side -----------------------------------------------------------------

    def wake(self, peer: bytes) -> None:
        """Wake the handlers waiting on `peer`'s buffer."""
        inbox = self._inboxes.get(peer)
        if inbox is not None:
            inbox.poke()

    def wake_all(self) -> None:
        for inbox in self._inboxes.values():
            inbox.poke()

    async def receive(self, src: bytes, msg: TensorMsg, payload: memoryview | None) -> dict:
        """Check a tensor from `src` and buffer it; the reply (accepted, or why not)."""
        name = peer_name(src)
        if self._closed is not None:
            return refuse(name, msg.tag, "communicator closed")
        epoch = self._rules.epoch
        if msg.run != self._run_id or msg.epoch != epoch:
            return refuse(name, msg.tag, f"run {msg.run.hex()[:8]} epoch {msg.epoch}, this peer is in "
                                         f"run {self._run_id.hex()[:8]} epoch {epoch}")
        inbox = self._inboxes.get(src)
        if inbox is None:
            return refuse(name, msg.tag, f"not a neighbour of this peer in epoch {epoch}")
        expected = self._rules.expect(src, msg.tag)
        if expected is None:
            return refuse(name, msg.tag, "not a tag this peer sends here under the plan")
        dtype, shape = msg.header["dtype"], msg.header["shape"]
        if dtype != expected[0]:
            return refuse(name, msg.tag, f"dtype {dtype!r}, the tag carries {expected[0]}")
        if tuple(shape) != expected[1] or any(type(s) is not int for s in shape):
            return refuse(name, msg.tag, f"shape {shape!r}, the tag carries {list(expected[1])}")
        nbytes = _nbytes(expected)
        if payload is None and nbytes == 0:
            payload = memoryview(b"")  # an empty payload travels as none
        try:
            tensor = tensor_from_wire(msg.header, payload, max_bytes=nbytes)
        except CodecError as e:  # untrusted bytes: refused like any other bad tensor
            return refuse(name, msg.tag, str(e))
        return await self._admit(inbox, msg, tensor, nbytes + ENTRY_OVERHEAD_BYTES)

    async def _admit(self, inbox: _Inbox, msg: TensorMsg, tensor: torch.Tensor, cost: int) -> dict:
        """Wait for `msg.seq`'s turn and room in the buffer, then buffer the tensor."""
        deadline = trio.current_time() + self._config.handler_wait_timeout_s
        window, seq, mine = self._config.window_messages, msg.seq, False
        try:
            while True:
                with inbox.cv:
                    if self._closed is not None or inbox.failed is not None:
                        return refuse(inbox.name, msg.tag, f"no longer receiving: {self._closed or inbox.failed}")
                    if seq < inbox.next_seq:
                        return refuse(inbox.name, msg.tag, f"duplicate sequence number {seq}", duplicate=True)
                    if seq >= inbox.next_seq + window:
                        return refuse(inbox.name, msg.tag, f"sequence number {seq} outside the window "
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
                        return ACCEPTED
                    changed, waiting_for = inbox.changed, inbox.next_seq
                with trio.move_on_at(deadline) as scope:
                    await changed.wait()
                if scope.cancelled_caught:
                    why = "no room in the buffer" if seq == waiting_for else f"sequence number {waiting_for} never came"
                    return refuse(inbox.name, msg.tag, f"{why} within {self._config.handler_wait_timeout_s} s")
        finally:
            if mine:
                with inbox.cv:
                    inbox.claimed.discard(seq)
            inbox.poke()
