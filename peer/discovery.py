"""Finding and keeping peers: bootstrap redials, address exchange, dialling learnt peers,
and goodbyes.

- One task per bootstrap address dials it, retrying with exponential backoff and jitter, and
  again whenever that connection drops.
- On every new connection, and every `exchange_interval_s` with one random peer, the two peers
  swap lists of their connected peers (PEER_EXCHANGE); new addresses are dialled.
- A peer that sends LEAVING is listed as departed and not redialled.

The decisions (whom to dial when, whom to forget) live in the sans-IO `PeerBook`.
"""

from __future__ import annotations

import logging
import math
import random

import trio

from dtfm.net import (
    Address,
    Connection,
    ConnectionClosed,
    HandshakeError,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    Transport,
    short_id,
)

from .config import DiscoveryConfig
from .peerbook import PeerBook, backoff_delay_s
from .pex import DaemonMsg, Leaving, PeerExchange, PeerRecord, dialable_address

logger = logging.getLogger(__name__)

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
DIAL_ERRORS = (OSError, ProtocolError, ConnectionClosed, RequestTimeout, RemoteError,
               trio.TooSlowError)


class Discovery:
    def __init__(self, transport: "Transport", config: DiscoveryConfig, *,
                 rng: random.Random | None = None):
        self.transport = transport
        self.config = config
        self.rng = random.Random() if rng is None else rng
        self.book = PeerBook(transport.peer_id, retry_initial_s=config.retry_initial_s,
                             retry_max_s=config.retry_max_s, departed_keep=config.departed_keep,
                             rng=self.rng)
        self.leaving = False
        self._wake_dialler = trio.Event()
        self._gone: dict[bytes, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        transport.handle(DaemonMsg.PEER_EXCHANGE, self._on_peer_exchange)
        transport.handle(DaemonMsg.LEAVING, self._on_leaving)
        transport.on_connect(self._on_connect)
        transport.on_disconnect(self._on_disconnect)

    async def run(self, bootstrap: tuple[Address, ...], own_address: Address, *,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Discover until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for address in bootstrap:
                if is_own_address(address, own_address):
                    logger.info("bootstrap address %s is this peer's own; skipped", address)
                    continue
                nursery.start_soon(self._bootstrap_loop, address)
            nursery.start_soon(self._dial_loop)
            nursery.start_soon(self._exchange_loop)
            task_status.started()

    async def say_goodbye(self, reason: str) -> None:
        """Tell every connected peer we are leaving; bounded by leave_timeout_s."""
        self.leaving = True
        body = Leaving(reason).to_wire()
        with trio.move_on_after(self.config.leave_timeout_s):
            async with trio.open_nursery() as nursery:
                for conn in self.transport.connections():
                    nursery.start_soon(self._send_goodbye, conn, body)

    async def _send_goodbye(self, conn: "Connection", body: dict) -> None:
        try:
            await conn.send(DaemonMsg.LEAVING, body)
        except DIAL_ERRORS as e:
            logger.debug("could not tell %s we are leaving: %s", conn.short_id, e)

    # ---- connection events -------------------------------------------------------------------

    def _on_connect(self, conn: "Connection") -> None:
        address = dialable_address(tuple(conn.listen_address), tuple(conn.remote_address))
        if address is None:
            logger.info("peer %s connected from %s:%s (does not listen)", conn.short_id,
                        *conn.remote_address[:2])
            return
        entry = self.book.entries.get(conn.peer_id)
        was_connected = entry is not None and entry.connected
        self.book.connected(conn.peer_id, address, conn.region, trio.current_time())
        self._gone.setdefault(conn.peer_id, trio.Event())
        if not was_connected:
            logger.info("peer %s connected, listens on %s region=%s", conn.short_id, address,
                        conn.region or "-")
        if self._nursery is not None and not self.leaving:
            self._nursery.start_soon(self._exchange_with, conn)

    def _on_disconnect(self, conn: "Connection", reason: str) -> None:
        live = self.transport.connection(conn.peer_id)
        if live is not None and live is not conn:
            return  # a duplicate connection closed; the peer is still connected
        gone = self._gone.pop(conn.peer_id, None)
        if gone is not None:
            gone.set()
        if conn.peer_id in self.book.departed or self.leaving:
            return
        self.book.disconnected(conn.peer_id, trio.current_time())
        logger.info("peer %s disconnected: %s", conn.short_id, reason or "connection closed")
        self._wake_dialler.set()

    async def _on_leaving(self, conn: "Connection", msg_type: int, body: object,
                          payload: bytes | None) -> None:
        msg = Leaving.from_wire(body)
        if self.book.left(conn.peer_id, trio.current_time(), msg.reason) is not None:
            logger.info("peer %s left the swarm: %s", conn.short_id, msg.reason or "no reason")
        return None

    async def _on_peer_exchange(self, conn: "Connection", msg_type: int, body: object,
                                payload: bytes | None) -> dict:
        self._learn(conn, PeerExchange.from_wire(body, max_peers=self.config.exchange_max_peers))
        return self._exchange_body(exclude=conn.peer_id).to_wire()

    # ---- address exchange --------------------------------------------------------------------

    def _exchange_body(self, exclude: bytes | None) -> PeerExchange:
        sample = self.book.sample_connected(self.config.exchange_max_peers, exclude=exclude)
        return PeerExchange(tuple(PeerRecord(e.peer_id, e.address, e.region) for e in sample))

    def _learn(self, conn: "Connection", exchange: PeerExchange) -> None:
        now = trio.current_time()
        new = [r for r in exchange.peers if self.book.learn(r.peer_id, r.address, r.region, now)]
        for record in new:
            logger.debug("learnt peer %s at %s from %s", short_id(record.peer_id), record.address,
                         conn.short_id)
        if new:
            self._wake_dialler.set()

    async def _exchange_with(self, conn: "Connection") -> None:
        body = self._exchange_body(exclude=conn.peer_id).to_wire()
        try:
            reply, _ = await conn.request(DaemonMsg.PEER_EXCHANGE, body,
                                          timeout_s=self.config.exchange_timeout_s)
            self._learn(conn, PeerExchange.from_wire(
                reply, max_peers=self.config.exchange_max_peers))
        except ProtocolError as e:
            logger.debug("bad peer exchange reply from %s: %s", conn.short_id, e)
            await conn.close(f"bad peer exchange reply: {e}")
        except (ConnectionClosed, RequestTimeout, RemoteError, OSError) as e:
            logger.debug("peer exchange with %s failed: %s", conn.short_id, e)

    async def _exchange_loop(self) -> None:
        while True:
            await trio.sleep(self.config.exchange_interval_s * (0.75 + 0.5 * self.rng.random()))
            peers = self.book.connected_peers()
            if not peers:
                continue
            conn = self.transport.connection(self.rng.choice(peers).peer_id)
            if conn is not None:
                await self._exchange_with(conn)

    # ---- dialling ----------------------------------------------------------------------------

    async def _dial(self, address: Address) -> "Connection":
        with trio.fail_after(self.config.connect_timeout_s):
            return await self.transport.connect(address.host, address.port)

    async def _dial_loop(self) -> None:
        assert self._nursery is not None
        while True:
            for peer_id, address in self.book.due(trio.current_time()):
                self._nursery.start_soon(self._dial_learnt, peer_id, address)
            next_at = self.book.next_due_at()
            with trio.move_on_at(math.inf if next_at is None else next_at):
                await self._wake_dialler.wait()
            self._wake_dialler = trio.Event()

    async def _dial_learnt(self, peer_id: bytes, address: Address) -> None:
        try:
            conn = await self._dial(address)
        except HandshakeError as e:
            logger.warning("peer %s at %s refused the handshake: %s", short_id(peer_id), address, e)
        except DIAL_ERRORS as e:
            logger.debug("dialling peer %s at %s failed: %s", short_id(peer_id), address, e)
        else:
            if conn.peer_id == peer_id:
                entry = self.book.entries.get(peer_id)
                if entry is not None and not entry.connected:
                    self._on_connect(conn)
                return
            logger.warning("address %s answered as peer %s, not %s", address, conn.short_id,
                           short_id(peer_id))
        if self.book.dial_failed(peer_id, trio.current_time()):
            logger.info("gave up on peer %s at %s", short_id(peer_id), address)
        self._wake_dialler.set()

    async def _bootstrap_loop(self, address: Address) -> None:
        """Keep a connection to one bootstrap address, redialling with backoff."""
        failures = 0
        while True:
            try:
                conn = await self._dial(address)
            except HandshakeError as e:
                failures += 1
                logger.error("bootstrap peer %s refused the handshake: %s", address, e)
            except DIAL_ERRORS as e:
                failures += 1
                level = logging.INFO if failures == 1 else logging.DEBUG
                logger.log(level, "bootstrap peer %s unreachable: %s; retrying with backoff",
                           address, _reason(e))
            else:
                if failures:
                    logger.info("reached bootstrap peer %s after %d failed tries", address,
                                failures)
                gone = self._gone.setdefault(conn.peer_id, trio.Event())
                if self.transport.connection(conn.peer_id) is not None:
                    await gone.wait()
                failures = 1
            await trio.sleep(backoff_delay_s(failures, self.config.retry_initial_s,
                                             self.config.retry_max_s, self.rng))


def is_own_address(address: Address, own: Address) -> bool:
    """True when dialling `address` would reach the listener at `own` (scripts often give
    every peer the same bootstrap list)."""
    if address.port != own.port:
        return False
    if address.host == own.host:
        return True
    return own.is_unspecified and address.host in LOCAL_HOSTS


def _reason(e: BaseException) -> str:
    if isinstance(e, trio.TooSlowError):
        return "timed out"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__
