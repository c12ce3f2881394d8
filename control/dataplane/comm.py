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

Ownership. `TransportComm` owns a `Sender` (send.py) and a `Receiver` (receive.py), each with
its own state, and the trio bridge, the run's nursery and the connections; `TensorRouter`
owns the transport's TENSOR handler. docs/control.md has the protocol.

Threads. Workers call `isend`/`recv` from their threads; the trio side is reached through the
`TrioToken` captured when the comm is created (it must be created inside trio), and thread-side
waits use `threading` primitives with timeouts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping

import torch
import trio

from dtfm.net import ConnectionClosed, PeerConnection, PeerTransport, ProtocolError
from dtfm.train import CommError, EventHandle, MessageRules

from ..messages import ControlMsg
from .config import CommConfig
from .receive import Receiver
from .router import TensorRouter
from .send import Sender
from .wire import MAX_RUN_BYTES, TensorMsg, peer_name, refuse

__all__ = ["TransportComm"]


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
        self._sender = Sender(transport, config, self.run_id, rules.epoch, self._token)
        self._receiver = Receiver(rules, config, self.run_id)
        self._stop = trio.Event()
        self._running = False  # between `run`'s start and its end
        self._connected: dict[bytes, trio.Event] = {}
        self._watching = False  # whether a lost connection fails its peer (from `connect` on)

    # ---- the worker's side (any thread) ------------------------------------------------

    def isend(self, peer: Hashable, tag: str, tensor: torch.Tensor) -> EventHandle:
        """Queue `tensor` (copied now) for `peer`; the handle completes when `peer` has buffered it."""
        return self._sender.submit(_peer_id(peer), tag, tensor)

    def recv(self, peer: Hashable, tag: str, timeout_s: float) -> torch.Tensor:
        """The next tensor `peer` sent under `tag`; CommError at once if `peer` fails."""
        peer = _peer_id(peer)
        tensor = self._receiver.take(peer, tag, timeout_s)
        self._in_trio(self._receiver.wake, peer)  # room for the handlers waiting on this buffer
        return tensor

    def fail(self, peer: bytes, reason: str) -> None:
        """Give up on `peer` (e.g. gossip declared it dead): its waiters raise CommError now."""
        self._receiver.fail(peer, reason)
        self._in_trio(self._fail_peer, peer, reason)

    def abort(self, reason: str) -> None:
        """Stop: every wait, send and handler of this comm ends with CommClosed."""
        self._sender.close(reason)
        self._receiver.close(reason)
        self._in_trio(self._stop.set)

    def close(self) -> None:
        self.abort("closed")

    def stats(self, peer: bytes) -> dict[str, int]:
        """Buffer and window figures for `peer` (a snapshot; for status and tests)."""
        return {**self._receiver.stats(peer), **self._sender.stats(peer)}

    def _in_trio(self, fn: Callable[..., object], *args: object) -> None:
        if threading.get_ident() == self._trio_thread:
            fn(*args)
            return
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    def _fail_peer(self, peer: bytes, reason: str) -> None:
        self._sender.fail(peer, reason)
        self._receiver.wake(peer)

    # ---- running (trio) ------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Receive through the router and run the senders, until `close()` or cancellation."""
        self._router.attach(self)
        try:
            async with trio.open_nursery() as nursery:
                self._sender.start(nursery)
                self._running = True
                task_status.started()
                await self._stop.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._running = False
            self._router.detach(self)
            self.abort("stopped")  # an earlier reason stays
            self._sender.stop()
            self._receiver.wake_all()

    async def connect(self, addresses: Mapping[bytes, tuple[str, int]], timeout_s: float) -> None:
        """Open connections to the peers this peer exchanges tensors with (`rules.peers`).

        Of each pair, the peer with the smaller id dials and the other waits for it (half the
        time, then dials too), so the two seldom race to replace each other's connection.
        Raises CommError naming the peers that could not be reached within `timeout_s`."""
        if not self._running:
            raise RuntimeError("TransportComm.run() must be running to connect")
        self._watching = True
        errors: list[str] = []
        with trio.move_on_after(timeout_s):
            async with trio.open_nursery() as nursery:
                for peer, (host, port) in addresses.items():
                    if peer != self.me:
                        nursery.start_soon(self._connect_one, peer, host, port, timeout_s / 2, errors)
        missing = [peer_name(p) for p in addresses if p != self.me and self._transport.connection(p) is None]
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
            errors.append(f"{peer_name(peer)} at {host}:{port}: {e}")
            return
        if conn.peer_id != peer:
            errors.append(f"{host}:{port} is peer {conn.short_id}, not {peer_name(peer)}")

    # ---- the router's calls (trio) -------------------------------------------------------

    async def _receive(self, src: bytes, msg: TensorMsg, payload: memoryview | None) -> dict:
        return await self._receiver.receive(src, msg, payload)

    def _on_connect(self, peer: bytes) -> None:
        event = self._connected.pop(peer, None)
        if event is not None:
            event.set()

    def _on_lost(self, peer: bytes, reason: str) -> None:
        if self._watching:  # before `connect`, a lost connection is simply dialled again
            # (the transport's reason may say it already: "connection lost: [Errno 104] ...")
            self.fail(peer, reason if reason.startswith("connection lost") else f"connection lost ({reason})")


def _peer_id(peer: Hashable) -> bytes:
    """Peers of the transport are their 32-byte ids."""
    if not isinstance(peer, bytes):
        raise CommError(f"not a peer id: {peer!r}")
    return peer
