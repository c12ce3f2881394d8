"""The peer daemon: listens for peers, joins the swarm through bootstrap addresses, swaps peer
addresses so every member finds every other, answers the control socket, hosts services, and
leaves cleanly.

Lifecycle of `Daemon.run()`, all inside one nursery:
  1. the transport listens (port 0 picks a free one);
  2. the control socket answers `status`, `leave`, and ops that services register;
  3. services added with `add_service` start, in order, each awaited until it calls started();
  4. discovery runs: one redial loop per bootstrap address, a dialler for learnt peers, and a
     periodic address exchange with a random connected peer;
  5. on `request_leave()` (the `leave` op, SIGINT or SIGTERM): tell every peer we are leaving,
     close the transport, cancel everything, return.
"""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from .addr import Address
from .config import DaemonConfig
from .control import ControlServer
from .errors import ConnectionClosed, HandshakeError, ProtocolError, RequestTimeout
from .paths import DataDir
from .peerbook import PeerBook, backoff_delay_s
from .pex import DaemonMsg, Leaving, PeerExchange, PeerRecord, dialable_address
from .status import CORE_KEYS
from .wire import pack

if TYPE_CHECKING:
    from .identity import Identity
    from .transport import Connection, Transport

logger = logging.getLogger(__name__)

Service = Callable[..., Awaitable[None]]   # async def svc(daemon, *, task_status)
StatusProvider = Callable[[], object]
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
DIAL_ERRORS = (OSError, ProtocolError, ConnectionClosed, RequestTimeout, trio.TooSlowError)


class ListenError(Exception):
    """The daemon could not listen on its address; str() says which and why."""


class Daemon:
    def __init__(self, config: DaemonConfig, identity: "Identity", transport: "Transport",
                 data_dir: DataDir, *, rng: random.Random | None = None):
        self.config = config
        self.identity = identity
        self.transport = transport
        self.data_dir = data_dir
        self.rng = random.Random() if rng is None else rng
        disc = config.discovery
        self.book = PeerBook(identity.peer_id, retry_initial_s=disc.retry_initial_s,
                             retry_max_s=disc.retry_max_s, departed_keep=disc.departed_keep,
                             rng=self.rng)
        self.control = ControlServer(data_dir.control_socket, config.control)
        self.control.register("status", self._op_status)
        self.control.register("leave", self._op_leave)
        self.listen_address: Address | None = None
        self.started_at: float | None = None
        self._services: list[tuple[str, Service]] = []
        self._providers: dict[str, StatusProvider] = {}
        self._leave_reason: str | None = None
        self._leave = trio.Event()
        self._wake_dialler = trio.Event()
        self._gone: dict[bytes, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        transport.handle(DaemonMsg.PEER_EXCHANGE, self._on_peer_exchange)
        transport.handle(DaemonMsg.LEAVING, self._on_leaving)
        transport.on_connect(self._on_connect)
        transport.on_disconnect(self._on_disconnect)

    @property
    def peer_id(self) -> bytes:
        return self.identity.peer_id

    @property
    def short_id(self) -> str:
        return self.identity.short_id

    # ---- extension points --------------------------------------------------------------------

    def add_service(self, service: Service, *, name: str | None = None) -> None:
        """Run `await service(daemon, task_status=...)` in the daemon's nursery once the
        transport listens. The service calls task_status.started() when ready; it is cancelled
        when the daemon leaves. An exception in a service stops the daemon."""
        if self.started_at is not None:
            raise RuntimeError("add services before Daemon.run()")
        self._services.append((name or getattr(service, "__qualname__", repr(service)), service))

    def add_status_provider(self, name: str, provider: StatusProvider) -> None:
        """Add `name: provider()` to every status report (a msgpack-able value)."""
        if name in CORE_KEYS or name in self._providers:
            raise ValueError(f"status field {name!r} is already taken")
        self._providers[name] = provider

    def add_control_op(self, op: str, handler: Callable[[dict], Awaitable[Any]]) -> None:
        """Answer control requests `op` with `await handler(args)`."""
        self.control.register(op, handler)

    def request_leave(self, reason: str = "leaving") -> None:
        """Start a clean exit (idempotent)."""
        if self._leave_reason is None:
            self._leave_reason = reason
            logger.info("leaving the swarm: %s", reason)
        self._leave.set()

    # ---- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listen = self.config.peer.listen
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                host, port = await nursery.start(self.transport.serve, listen.host, listen.port)
            except OSError as e:
                raise ListenError(f"cannot listen on {listen}: {e.strerror or e}") from None
            self.listen_address = Address(host, port)
            self.started_at = trio.current_time()
            await nursery.start(self.control.serve)
            logger.info("peer %s listening on %s region=%s control=%s", self.short_id,
                        self.listen_address, self.config.peer.region or "-",
                        self.data_dir.control_socket)
            for name, service in self._services:
                logger.debug("starting service %s", name)
                await nursery.start(service, self)
            for address in self.config.peer.bootstrap:
                if self._is_own_address(address):
                    logger.info("bootstrap address %s is this peer's own; skipped", address)
                    continue
                nursery.start_soon(self._bootstrap_loop, address)
            nursery.start_soon(self._dial_loop)
            nursery.start_soon(self._exchange_loop)
            task_status.started(self.listen_address)
            await self._leave.wait()
            await self._say_goodbye(self._leave_reason or "leaving")
            nursery.cancel_scope.cancel()
        logger.info("left the swarm")

    def _is_own_address(self, address: Address) -> bool:
        """True when dialling `address` would reach this daemon's own listener (scripts often
        give every peer the same bootstrap list)."""
        own = self.listen_address
        if own is None or address.port != own.port:
            return False
        if address.host == own.host:
            return True
        return own.is_unspecified and address.host in LOCAL_HOSTS

    async def _say_goodbye(self, reason: str) -> None:
        connections = list(self.transport.connections())
        body = Leaving(reason).to_wire()
        with trio.move_on_after(self.config.discovery.leave_timeout_s):
            async with trio.open_nursery() as nursery:
                for conn in connections:
                    nursery.start_soon(self._send_goodbye, conn, body)
        with trio.move_on_after(self.config.discovery.leave_timeout_s) as scope:
            scope.shield = True
            await self.transport.aclose()

    async def _send_goodbye(self, conn: "Connection", body: dict) -> None:
        try:
            await conn.send(DaemonMsg.LEAVING, body)
        except DIAL_ERRORS as e:
            logger.debug("could not tell %s we are leaving: %s", conn.short_id, e)

    # ---- connection events -------------------------------------------------------------------

    def _on_connect(self, conn: "Connection") -> None:
        address = dialable_address(tuple(conn.listen_address), tuple(conn.remote_address))
        if address is None:
            logger.info("peer %s connected from %s (does not listen)", conn.short_id,
                        _fmt(conn.remote_address))
            return
        was_connected = conn.peer_id in self.book.entries and \
            self.book.entries[conn.peer_id].connected
        self.book.connected(conn.peer_id, address, conn.region, trio.current_time())
        self._gone.setdefault(conn.peer_id, trio.Event())
        if not was_connected:
            logger.info("peer %s connected, listens on %s region=%s", conn.short_id, address,
                        conn.region or "-")
        if self._nursery is not None and not self._leave.is_set():
            self._nursery.start_soon(self._exchange_with, conn)

    def _on_disconnect(self, conn: "Connection", reason: str) -> None:
        live = self.transport.connection(conn.peer_id)
        if live is not None and live is not conn:
            return  # a duplicate connection closed; the peer is still connected
        gone = self._gone.pop(conn.peer_id, None)
        if gone is not None:
            gone.set()
        if conn.peer_id in self.book.departed or self._leave.is_set():
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
        self._learn(conn, PeerExchange.from_wire(body, max_peers=self._max_exchange()))
        return self._exchange_body(exclude=conn.peer_id).to_wire()

    # ---- discovery ---------------------------------------------------------------------------

    def _max_exchange(self) -> int:
        return self.config.discovery.exchange_max_peers

    def _exchange_body(self, exclude: bytes | None) -> PeerExchange:
        sample = self.book.sample_connected(self._max_exchange(), exclude=exclude)
        return PeerExchange(tuple(PeerRecord(e.peer_id, e.address, e.region) for e in sample))

    def _learn(self, conn: "Connection", exchange: PeerExchange) -> None:
        now = trio.current_time()
        new = [r for r in exchange.peers if self.book.learn(r.peer_id, r.address, r.region, now)]
        for record in new:
            logger.debug("learnt peer %s at %s from %s", record.peer_id[:4].hex(),
                         record.address, conn.short_id)
        if new:
            self._wake_dialler.set()

    async def _exchange_with(self, conn: "Connection") -> None:
        body = self._exchange_body(exclude=conn.peer_id).to_wire()
        try:
            reply, _ = await conn.request(DaemonMsg.PEER_EXCHANGE, body,
                                          timeout_s=self.config.discovery.exchange_timeout_s)
            self._learn(conn, PeerExchange.from_wire(reply, max_peers=self._max_exchange()))
        except ProtocolError as e:
            logger.debug("bad peer exchange reply from %s: %s", conn.short_id, e)
            await conn.close(f"bad peer exchange reply: {e}")
        except (ConnectionClosed, RequestTimeout, OSError) as e:
            logger.debug("peer exchange with %s failed: %s", conn.short_id, e)

    async def _exchange_loop(self) -> None:
        while True:
            await trio.sleep(self.config.discovery.exchange_interval_s
                             * (0.75 + 0.5 * self.rng.random()))
            peers = self.book.connected_peers()
            if not peers:
                continue
            conn = self.transport.connection(self.rng.choice(peers).peer_id)
            if conn is not None:
                await self._exchange_with(conn)

    async def _dial_loop(self) -> None:
        assert self._nursery is not None
        while True:
            for peer_id, address in self.book.due(trio.current_time()):
                self._nursery.start_soon(self._dial_learnt, peer_id, address)
            next_at = self.book.next_due_at()
            with trio.move_on_at(math.inf if next_at is None else next_at):
                await self._wake_dialler.wait()
            self._wake_dialler = trio.Event()

    async def _dial(self, address: Address) -> "Connection":
        with trio.fail_after(self.config.discovery.connect_timeout_s):
            return await self.transport.connect(address.host, address.port)

    async def _dial_learnt(self, peer_id: bytes, address: Address) -> None:
        try:
            conn = await self._dial(address)
        except HandshakeError as e:
            logger.warning("peer %s at %s refused the handshake: %s", peer_id[:4].hex(),
                           address, e)
        except DIAL_ERRORS as e:
            logger.debug("dialling peer %s at %s failed: %s", peer_id[:4].hex(), address, e)
        else:
            if conn.peer_id == peer_id:
                entry = self.book.entries.get(peer_id)
                if entry is not None and not entry.connected:
                    self._on_connect(conn)
                return
            logger.warning("address %s answered as peer %s, not %s", address, conn.short_id,
                           peer_id[:4].hex())
        if self.book.dial_failed(peer_id, trio.current_time()):
            logger.info("gave up on peer %s at %s", peer_id[:4].hex(), address)
        self._wake_dialler.set()

    async def _bootstrap_loop(self, address: Address) -> None:
        """Keep a connection to one bootstrap address, redialling with backoff."""
        disc = self.config.discovery
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
                failures = 0
                gone = self._gone.setdefault(conn.peer_id, trio.Event())
                if self.transport.connection(conn.peer_id) is not None:
                    await gone.wait()
                failures = 1
            await trio.sleep(backoff_delay_s(failures, disc.retry_initial_s, disc.retry_max_s,
                                             self.rng))

    # ---- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        peers = []
        for entry in sorted(self.book.connected_peers(), key=lambda e: e.peer_id):
            conn = self.transport.connection(entry.peer_id)
            last_seen = conn.last_seen if conn is not None else now
            peers.append({
                "peer_id": entry.peer_id.hex(), "short_id": entry.peer_id[:4].hex(),
                "address": str(entry.address), "region": entry.region,
                "last_seen_s_ago": max(0.0, now - last_seen),
                "connected_for_s": max(0.0, now - (entry.connected_since or now)),
            })
        departed = [{
            "peer_id": d.peer_id.hex(), "short_id": d.peer_id[:4].hex(),
            "address": str(d.address), "region": d.region, "left_s_ago": max(0.0, now - d.at),
            "reason": d.reason} for d in reversed(self.book.departed.values())]
        report: dict[str, Any] = {
            "peer_id": self.peer_id.hex(), "short_id": self.short_id,
            "listen": str(self.listen_address), "region": self.config.peer.region,
            "pid": os.getpid(), "data_dir": str(self.data_dir.root),
            "uptime_s": now - (self.started_at if self.started_at is not None else now),
            "peers": peers, "departed": departed,
        }
        for name, provider in self._providers.items():
            report[name] = _provided(name, provider)
        return report

    async def _op_status(self, args: dict) -> dict[str, Any]:
        return self.status()

    async def _op_leave(self, args: dict) -> dict[str, Any]:
        self.request_leave("asked to leave over the control socket")
        return {"leaving": True, "pid": os.getpid()}


def _provided(name: str, provider: StatusProvider) -> object:
    try:
        value = provider()
        pack(value)  # must cross the control socket
        return value
    except Exception as e:
        logger.warning("status provider %s failed: %s: %s", name, type(e).__name__, e)
        return {"error": f"{type(e).__name__}: {e}"}


def _fmt(address: object) -> str:
    try:
        host, port = address  # type: ignore[misc]
        return str(Address(host, port))
    except (TypeError, ValueError):
        return str(address)


def _reason(e: BaseException) -> str:
    if isinstance(e, trio.TooSlowError):
        return "timed out"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__
