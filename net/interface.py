"""The transport's interface: what code above the transport (gossip, the daemon, training)
may use of a transport and of its connections.

Two implementations satisfy it: `Transport` / `Connection` (TCP, handshake, encrypted records)
and `MemTransport` / `MemConnection` (an in-memory network under trio's MockClock, for tests).
`tests/net/test_transport_contract.py` runs the same tests against both. Behaviour both share:

- A handler is `async handler(conn, msg_type, body, payload)`. For a request it returns the
  reply body, or a `Reply` to send a raw payload as well; for a one-way message the result is
  ignored. A received payload is a writable `memoryview` of bytes, or None.
- A handler that raises `ProtocolError` (the body it was given is bad) closes that connection:
  both ends see it closed, the disconnect callbacks fire on both, and requests waiting on it
  raise `ConnectionClosed`. Any other exception from a handler becomes an error reply, which
  the requester sees as `RemoteError`; the connection stays up.
- `request()` raises `RequestTimeout` when no reply comes within `timeout_s` (by default the
  transport's `request_timeout_s`), `ConnectionClosed` when the connection closes first, and
  `RemoteError` when the peer answers with an error (no handler for the type, busy, handler
  failure). A reply to no request in flight (late, after a timeout) is dropped.
- `send()` and `request()` on a closed connection raise `ConnectionClosed`; a body or payload
  over the transport's limits, or a message type outside 0-255, raises `ValueError`.
- `droppable=True` lets the link drop a one-way message (full queue, lossy emulated link);
  no other message is lost while the connection stays open.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["Handler", "PeerConnection", "PeerTransport", "Reply"]

Payload = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Reply:
    """A handler's reply that carries a raw payload as well as a body."""

    body: object
    payload: Payload | None = None


@runtime_checkable
class PeerConnection(Protocol):
    """A live connection to one peer."""

    peer_id: bytes
    short_id: str  # the peer id's first 8 hex characters, for log lines
    region: str  # the peer's region, as it announced it
    listen_address: tuple[str, int]  # where the peer accepts connections
    remote_address: tuple[str, int]  # the other end of this connection
    closed: bool
    close_reason: str  # why it closed; "" while open
    # Payload bytes (tensors, weight chunks: not the message bodies) handed to this connection to
    # send (replies included) and received on it; the daemon's status and metrics show them.
    payload_bytes_sent: int
    payload_bytes_received: int

    @property
    def last_seen(self) -> float:
        """trio.current_time() when the last frame from the peer arrived."""
        ...

    async def request(self, msg_type: int, body: object, *, payload: Payload | None = None,
                      timeout_s: float | None = None) -> tuple[object, memoryview | None]:
        """Send a request and wait for its reply `(body, payload)`."""
        ...

    async def send(self, msg_type: int, body: object, *, payload: Payload | None = None,
                   droppable: bool = False) -> None:
        """Send a one-way message."""
        ...

    async def close(self, reason: str = "") -> None:
        """Close the connection, telling the peer why (best effort)."""
        ...


# (conn, msg_type, body, payload) -> reply body or Reply (requests); ignored for one-way messages
Handler = Callable[[PeerConnection, int, object, memoryview | None], Awaitable[object]]


@runtime_checkable
class PeerTransport(Protocol):
    """One peer's endpoint: dials peers, accepts their connections, runs handlers.

    Starting it (listening, or joining an in-memory network) is the owner's business and not
    part of the interface."""

    peer_id: bytes
    region: str
    listen_address: tuple[str, int]

    def handle(self, msg_type: int, handler: Handler) -> None:
        """Run `handler` for every incoming message of `msg_type` (one handler per type; 0 and
        1 belong to the transport)."""
        ...

    def on_connect(self, cb: Callable[[PeerConnection], None]) -> None:
        """Call `cb(conn)` when a connection to a peer is established, either way."""
        ...

    def on_disconnect(self, cb: Callable[[PeerConnection, str], None]) -> None:
        """Call `cb(conn, reason)` when an established connection closes, whoever closed it."""
        ...

    async def connect(self, host: str, port: int, *, peer_id: bytes | None = None) -> PeerConnection:
        """A connection to the peer listening at host:port, reusing a live one. Raises when the
        peer cannot be reached (OSError, TimeoutError, HandshakeError, ConnectionClosed).

        Connections are known by the peer id their handshake verified, never by the listen
        address a peer announces. With `peer_id`, only a live connection to that peer is
        reused, and a peer at host:port that proves another id is refused (HandshakeError
        naming both ids; no connection is kept). Pass it whenever the caller knows whom it
        means to reach."""
        ...

    def connection(self, peer_id: bytes) -> PeerConnection | None:
        """The live connection to `peer_id`, if there is one."""
        ...

    def connections(self) -> Sequence[PeerConnection]:
        """Every live connection."""
        ...

    async def aclose(self) -> None:
        """Close every connection (telling the peers) and stop."""
        ...
