"""The `Comm` interface training uses to reach other peers, and its in-memory implementation.

Synchronous on purpose: stage workers run torch compute in threads, so every call blocks (with
a timeout) or, for sends, returns a handle to wait on later. Peers are opaque ids (str or
bytes); a message is one tensor addressed by (destination, tag) and received by (source, tag),
FIFO per (source, tag). A tensor maps naturally onto a message: a header (dtype name, shape)
plus its raw bytes (`codec.py`), which is how the peer transport carries it and how the
in-memory hub passes it on.
Collectives are built on send/recv in `collective.py`, so a transport implements only these.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol, TypeVar

import torch

from .codec import tensor_from_wire, tensor_to_wire
from .errors import CommClosed, CommError, CommTimeout, PeerId, raised_again

__all__ = [
    "Comm", "SendHandle", "CommError", "CommTimeout", "CommClosed", "InMemoryHub", "InMemoryComm", "Link", "EventHandle",
    "PendingSends", "settle_sends",
]



T = TypeVar("T")

class SendHandle(Protocol):
    def wait(self, timeout_s: float) -> None:
        """Block until the message has left this peer's hands; raise CommTimeout/CommError."""


class PendingSends:
    """Send handles nobody has waited for yet: the acknowledgements a training step leaves
    behind instead of waiting for them on its critical path.

    A collective needs its own sends acknowledged only to learn that they failed; it has what it
    needs once it has received. A step therefore adds its handles here and the caller waits for
    them later (`wait`), when they are long acknowledged: `run_step` before the next step
    changes the state, the stage runner before a checkpoint and where the run ends. Every `Comm`
    copies a tensor in `isend`, so nothing here keeps a tensor alive. Owned by one thread."""

    def __init__(self) -> None:
        self._handles: list[SendHandle] = []

    def add(self, handle: SendHandle) -> None:
        self._handles.append(handle)

    def take(self) -> PendingSends:
        """The handles held so far, moved to a new PendingSends (this one is left empty)."""
        out = PendingSends()
        out._handles, self._handles = self._handles, []
        return out

    def wait(self, timeout_s: float) -> None:
        """Wait for every handle (each within `timeout_s`), in the order they were added; the
        first failure raises CommError/CommTimeout. Empty afterwards, even when one failed: a
        failed send breaks its step, and the step's other handles say nothing more."""
        handles, self._handles = self._handles, []
        for h in handles:
            h.wait(timeout_s)

    def drop(self) -> None:
        """Forget every handle (their step failed, or their comm is closed)."""
        self._handles = []

    def __len__(self) -> int:
        return len(self._handles)


def settle_sends(handles: list[SendHandle], pending: PendingSends | None, timeout_s: float) -> None:
    """Wait for `handles` now, or leave them in `pending` to be waited for later."""
    if pending is None:
        for h in handles:
            h.wait(timeout_s)
    else:
        for h in handles:
            pending.add(h)


class Comm(Protocol):
    """What training needs from the network. `me` is this peer's id."""

    @property
    def me(self) -> PeerId: ...

    def isend(self, peer: PeerId, tag: str, tensor: torch.Tensor) -> SendHandle:
        """Start sending `tensor` (copied now: the caller may reuse it) to `peer` under `tag`."""

    def recv(self, peer: PeerId, tag: str, timeout_s: float) -> torch.Tensor:
        """The next tensor `peer` sent under `tag`; raise CommTimeout after `timeout_s`."""


class EventHandle:
    """A send handle completed from another thread: for transports whose sends run elsewhere
    (e.g. a trio task started with `trio.from_thread.run_sync`), which call `done()` or
    `fail(exc)` when the frame has been written or the write failed."""

    def __init__(self, what: str = "send"):
        self.what = what
        self._event = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> None:
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    def wait(self, timeout_s: float) -> None:
        if not self._event.wait(timeout_s):
            raise CommTimeout(f"timed out after {timeout_s} s waiting to {self.what}")
        if self._error is not None:
            raise raised_again(self._error, self.what)


class _Done:
    """The handle of a send that has already been handed over."""

    def wait(self, timeout_s: float) -> None:
        return None


@dataclass(frozen=True)
class Link:
    """An emulated one-way link for InMemoryHub."""

    latency_s: float  # one-way delay added to every message
    bandwidth_bytes_per_s: float  # serialisation rate; messages on one link queue behind each other

    def __post_init__(self) -> None:
        if self.latency_s < 0 or not self.bandwidth_bytes_per_s > 0:
            raise ValueError("latency must be non-negative and bandwidth positive")


class _OnLink:
    """The handle of a send on an emulated link: done when the link has sent it."""

    def __init__(self, hub: "InMemoryHub", sent_at: float, what: str):
        self.hub, self.sent_at, self.what = hub, sent_at, what

    def wait(self, timeout_s: float) -> None:
        if self.sent_at - time.monotonic() > timeout_s:
            raise CommTimeout(f"timed out after {timeout_s} s waiting to {self.what}")
        self.hub._sleep_until(self.sent_at, self.what)


@dataclass(eq=False)
class _Channel:
    """The queue of one (src, dst, tag) and its sends in progress: the hub drops it only when no
    send is in progress and it is empty."""

    queue: queue.Queue
    senders: int = 0


class InMemoryHub:
    """Connects InMemoryComm endpoints in one process through bounded queues.

    `capacity` bounds each (source, destination, tag) queue; a send into a full queue blocks
    (back-pressure) until there is room or the timeout passes. `abort()` wakes every waiter
    with CommClosed, so one failed worker cannot leave the others hanging.

    `link(src, dst) -> Link` optionally emulates the network: each directed pair is a link
    that carries one message at a time (bytes / bandwidth), and a message arrives one latency
    after it has been sent. A send handle's `wait` returns when the link has finished sending
    it; `recv` returns the message when it has arrived. Without `link` delivery is immediate.
    """

    def __init__(self, capacity: int = 64, link: "Callable[[PeerId, PeerId], Link] | None" = None):
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.link = link
        self._link_free_at: dict[tuple, float] = {}
        self._lock = threading.Lock()
        self._queues: dict[tuple, _Channel] = {}
        self._aborted = threading.Event()
        self.bytes_sent = 0  # total payload bytes, for benchmarks

    def endpoint(self, me: PeerId) -> "InMemoryComm":
        return InMemoryComm(self, me)

    def abort(self) -> None:
        self._aborted.set()

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def _channel(self, src: PeerId, dst: PeerId, tag: str, sending: bool) -> _Channel:
        key = (src, dst, tag)
        with self._lock:
            ch = self._queues.get(key)
            if ch is None:
                ch = self._queues[key] = _Channel(queue.Queue(self.capacity))
            if sending:
                ch.senders += 1
            return ch

    def _release(self, src: PeerId, dst: PeerId, tag: str, ch: _Channel, sending: bool) -> None:
        with self._lock:
            if sending:
                ch.senders -= 1
            if ch.senders == 0 and ch.queue.empty() and self._queues.get((src, dst, tag)) is ch:
                del self._queues[(src, dst, tag)]

    def _schedule(self, src: PeerId, dst: PeerId, nbytes: int) -> tuple[float, float]:
        """(sent_at, arrives_at) on the monotonic clock for a message on the emulated link;
        (0, 0) without one."""
        if self.link is None:
            return 0.0, 0.0
        lk = self.link(src, dst)
        now = time.monotonic()
        with self._lock:
            start = max(now, self._link_free_at.get((src, dst), now))
            sent = start + nbytes / lk.bandwidth_bytes_per_s
            self._link_free_at[(src, dst)] = sent
        return sent, sent + lk.latency_s

    def _sleep_until(self, t: float, what: str) -> None:
        left = t - time.monotonic()
        if left > 0 and self._aborted.wait(left):
            raise CommClosed(f"communicator aborted while waiting to {what}")

    def _wait(self, op: Callable[[float], T], timeout_s: float, what: str) -> T:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._aborted.is_set():
                raise CommClosed(f"communicator aborted while waiting to {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeout(f"timed out after {timeout_s} s waiting to {what}")
            try:
                return op(min(left, 0.05))
            except (queue.Empty, queue.Full):
                continue


class InMemoryComm:
    """One peer's endpoint on an InMemoryHub."""

    send_timeout_s = 60.0  # how long a send may wait for room in a full queue

    def __init__(self, hub: InMemoryHub, me: PeerId):
        self.hub, self.me = hub, me

    def isend(self, peer: PeerId, tag: str, tensor: torch.Tensor) -> SendHandle:
        header, view = tensor_to_wire(tensor)  # encoded as on the wire, so the same dtype rule holds
        payload = bytearray(view)  # the copy that frees the caller's tensor
        nbytes = len(payload)
        what = f"send {tag!r} to {peer!r}"
        sent_at, arrives_at = self.hub._schedule(self.me, peer, nbytes)
        ch = self.hub._channel(self.me, peer, tag, sending=True)
        try:
            self.hub._wait(lambda t: ch.queue.put((arrives_at, (header, payload)), timeout=t), self.send_timeout_s,
                           what)
        finally:
            self.hub._release(self.me, peer, tag, ch, sending=True)
        with self.hub._lock:
            self.hub.bytes_sent += nbytes
        return _OnLink(self.hub, sent_at, what) if self.hub.link else _Done()

    def recv(self, peer: PeerId, tag: str, timeout_s: float) -> torch.Tensor:
        what = f"receive {tag!r} from {peer!r}"
        ch = self.hub._channel(peer, self.me, tag, sending=False)
        try:
            arrives_at, (header, payload) = self.hub._wait(lambda t: ch.queue.get(timeout=t), timeout_s, what)
        finally:
            self.hub._release(peer, self.me, tag, ch, sending=False)
        self.hub._sleep_until(arrives_at, what)  # on an emulated link: not before it arrives
        return tensor_from_wire(header, payload, max_bytes=len(payload))  # no copy: the hub hands it over

    @property
    def open_channels(self) -> int:
        return len(self.hub._queues)
