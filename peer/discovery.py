"""Finding and keeping peers: bootstrap redials, address exchange, dialling learnt peers,
and goodbyes.

- One task per bootstrap address dials it, retrying with exponential backoff and jitter, and
  again whenever that connection drops.
- On every new connection, and every `exchange_interval_s` with one random peer, the two peers
  swap lists of their connected peers (PEER_EXCHANGE); new addresses are dialled.
- A peer that sends LEAVING is listed as departed and not redialled.
- A peer listening on a wildcard asks the peers it meets which address they see it at
  (ADDRESS_QUERY) and advertises the first one confirmed by a dial back (dtfm.peer.advertise).

Bounded against members that lie or flood: address lists are accepted from one peer at most
`exchange_rate_per_s` (burst `exchange_burst`), the peer book is capped (`max_known_peers`,
`max_peers_per_source`), and at most `max_concurrent_dials` dials run at once; the peer book
is the queue of the rest.

The decisions (whom to dial when, whom to forget) live in the sans-IO `PeerBook`.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable

import trio

from dtfm.net import (
    Address,
    AddressError,
    Connection,
    ConnectionClosed,
    PeerConnection,
    HandshakeError,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    Transport,
    short_id,
)

from .advertise import Advertiser
from .config import DiscoveryConfig
from .peerbook import PeerBook, backoff_delay_s
from .pex import AddressQuery, AddressSeen, DaemonMsg, Leaving, PeerExchange, PeerRecord, dialable_address
from .ratelimit import SourceRate

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
                             max_entries=config.max_known_peers,
                             max_per_source=config.max_peers_per_source, rng=self.rng)
        self.exchange_rate = SourceRate(config.exchange_rate_per_s, config.exchange_burst)
        self.query_rate = SourceRate(config.exchange_rate_per_s, config.exchange_burst)
        # Every dial (learnt peers, bootstrap redials, confirming an address) holds a slot.
        self.dial_slots = trio.CapacityLimiter(config.max_concurrent_dials)
        self.advertiser: Advertiser | None = None
        self._advertise_listeners: list[Callable[[Address], None]] = []
        self._asking = False
        self._dial_tasks = 0
        self.leaving = False
        self._wake_dialler = trio.Event()
        self._gone: dict[bytes, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        transport.handle(DaemonMsg.PEER_EXCHANGE, self._on_peer_exchange)
        transport.handle(DaemonMsg.LEAVING, self._on_leaving)
        transport.handle(DaemonMsg.ADDRESS_QUERY, self._on_address_query)
        transport.on_connect(self._on_connect)
        transport.on_disconnect(self._on_disconnect)

    # ---- the advertised address ---------------------------------------------------------------

    def start_advertising(self, listen: Address, configured: Address | None,
                          bootstrap: tuple[Address, ...]) -> Address | None:
        """Decide the advertised address once the transport listens (`listen` holds the bound
        port); returns it, or None while it waits for a peer to confirm one."""
        self.advertiser = Advertiser(listen, configured, bootstrap)
        address = self.advertiser.address
        if address is not None:
            self.transport.listen_address = (address.host, address.port)
            logger.info("advertising %s to peers", address)
        else:
            logger.info("listening on %s: will advertise the address peers see and confirm",
                        listen)
        return address

    @property
    def advertised(self) -> Address | None:
        return None if self.advertiser is None else self.advertiser.address

    def on_advertise(self, callback: Callable[[Address], None]) -> None:
        """Call callback(address) when a confirmed address is adopted after start."""
        self._advertise_listeners.append(callback)

    def _maybe_ask(self, conn: PeerConnection) -> None:
        if (self.advertiser is not None and self.advertiser.needs_confirmation
                and not self._asking and self._nursery is not None and not self.leaving):
            self._asking = True
            self._nursery.start_soon(self._ask_address, conn)

    async def _ask_address(self, conn: PeerConnection) -> None:
        assert self.advertiser is not None
        body = AddressQuery(self.advertiser.query_port()).to_wire()
        try:
            for _ in range(2):   # once more if a dial back replaced this connection
                try:
                    reply, _ = await conn.request(DaemonMsg.ADDRESS_QUERY, body,
                                                  timeout_s=self.config.address_query_timeout_s)
                    seen = AddressSeen.from_wire(reply)
                except ConnectionClosed as e:
                    live = self.transport.connection(conn.peer_id)
                    if live is None or live is conn:
                        logger.debug("address query to %s failed: %s", conn.short_id, e)
                        return
                    conn = live
                    continue
                break
            else:
                return
        except ProtocolError as e:
            logger.debug("bad address query reply from %s: %s", conn.short_id, e)
            await conn.close(f"bad address query reply: {e}")
            return
        except (RequestTimeout, RemoteError, OSError) as e:
            logger.debug("address query to %s failed: %s", conn.short_id, e)
            return
        finally:
            self._asking = False
        adopted, why = self.advertiser.observed(seen, conn.peer_id)
        if adopted is None:
            logger.debug("peer %s sees us at %s: not adopted: %s", conn.short_id, seen.address,
                         why)
            return
        self.transport.listen_address = (adopted.host, adopted.port)
        logger.info("advertising %s to peers: peer %s sees us there and dialled us back",
                    adopted, conn.short_id)
        for callback in self._advertise_listeners:
            callback(adopted)

    async def _on_address_query(self, conn: PeerConnection, msg_type: int, body: object,
                                payload: memoryview | None) -> dict:
        query = AddressQuery.from_wire(body)
        try:
            seen = Address(conn.remote_address[0], query.port)
        except AddressError as e:
            raise ProtocolError(f"address query: {e}") from None
        confirmed = False
        if not self.query_rate.allow(conn.peer_id, trio.current_time()):
            logger.debug("address query from %s over its rate: not dialling back",
                         conn.short_id)
        else:
            confirmed = await self._dials_back(conn.peer_id, seen)
        return AddressSeen(seen, confirmed).to_wire()

    async def _dials_back(self, peer_id: bytes, address: Address) -> bool:
        """True if a dial to `address` completes a handshake with `peer_id`."""
        try:
            other = await self._dial(address)
        except DIAL_ERRORS as e:
            logger.debug("dial back to %s at %s failed: %s", short_id(peer_id), address, e)
            return False
        return other.peer_id == peer_id

    # ---- running -----------------------------------------------------------------------------

    async def run(self, bootstrap: tuple[Address, ...], own_address: Address, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
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

    async def _send_goodbye(self, conn: PeerConnection, body: dict) -> None:
        try:
            await conn.send(DaemonMsg.LEAVING, body)
        except DIAL_ERRORS as e:
            logger.debug("could not tell %s we are leaving: %s", conn.short_id, e)

    # ---- connection events -------------------------------------------------------------------

    def _on_connect(self, conn: PeerConnection) -> None:
        self._maybe_ask(conn)
        address = dialable_address(conn.listen_address, conn.remote_address)
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

    def _on_disconnect(self, conn: PeerConnection, reason: str) -> None:
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

    async def _on_leaving(self, conn: PeerConnection, msg_type: int, body: object,
                          payload: memoryview | None) -> None:
        msg = Leaving.from_wire(body)
        if self.book.left(conn.peer_id, trio.current_time(), msg.reason) is not None:
            logger.info("peer %s left the swarm: %s", conn.short_id, msg.reason or "no reason")
        return None

    async def _on_peer_exchange(self, conn: PeerConnection, msg_type: int, body: object,
                                payload: memoryview | None) -> dict:
        exchange = PeerExchange.from_wire(body, max_peers=self.config.exchange_max_peers)
        if not self._learn(conn, exchange):
            return PeerExchange(()).to_wire()
        return self._exchange_body(exclude=conn.peer_id).to_wire()

    # ---- address exchange --------------------------------------------------------------------

    def _exchange_body(self, exclude: bytes | None) -> PeerExchange:
        sample = self.book.sample_connected(self.config.exchange_max_peers, exclude=exclude)
        return PeerExchange(tuple(PeerRecord(e.peer_id, e.address, e.region) for e in sample))

    def _learn(self, conn: PeerConnection, exchange: PeerExchange) -> bool:
        """Take in a peer's address list; False if it came over that peer's rate."""
        now = trio.current_time()
        if not self.exchange_rate.allow(conn.peer_id, now):
            logger.debug("address list from %s over its rate (%g/s): ignored", conn.short_id,
                         self.config.exchange_rate_per_s)
            return False
        new = [r for r in exchange.peers
               if self.book.learn(r.peer_id, r.address, r.region, now, source=conn.peer_id)]
        for record in new:
            logger.debug("learnt peer %s at %s from %s", short_id(record.peer_id), record.address,
                         conn.short_id)
        if new:
            self._wake_dialler.set()
        return True

    async def _exchange_with(self, conn: PeerConnection) -> None:
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
                self._maybe_ask(conn)
                await self._exchange_with(conn)

    # ---- dialling ----------------------------------------------------------------------------

    async def _dial(self, address: Address) -> "Connection":
        async with self.dial_slots:
            with trio.fail_after(self.config.connect_timeout_s):
                return await self.transport.connect(address.host, address.port)

    async def _dial_loop(self) -> None:
        assert self._nursery is not None
        while True:
            free = self.config.max_concurrent_dials - self._dial_tasks
            for peer_id, address in self.book.due(trio.current_time(), limit=free):
                self._dial_tasks += 1
                self._nursery.start_soon(self._dial_learnt, peer_id, address)
            next_at = self.book.next_due_at() if self._dial_tasks < self.config.max_concurrent_dials else None
            with trio.move_on_at(math.inf if next_at is None else next_at):
                await self._wake_dialler.wait()
            self._wake_dialler = trio.Event()

    async def _dial_learnt(self, peer_id: bytes, address: Address) -> None:
        try:
            await self._dial_learnt_once(peer_id, address)
        finally:
            self._dial_tasks -= 1
            self._wake_dialler.set()

    async def _dial_learnt_once(self, peer_id: bytes, address: Address) -> None:
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
