"""The peer daemon: listens for peers, joins the swarm (dtfm.peer.discovery), answers the
control socket, hosts services, and leaves cleanly.

Lifecycle of `Daemon.run()`, all inside one nursery:
  1. the transport listens (port 0 picks a free one) and the advertised address is decided
     (dtfm.peer.advertise);
  2. the control socket answers `status`, `leave`, and ops that services register;
  3. services added with `add_service` start, in order, each awaited until it calls started();
  4. discovery runs: bootstrap redials, address exchange, dialling learnt peers;
  5. on `request_leave()` (the `leave` op, SIGINT or SIGTERM): run the leave hooks in order
     while the transport is still up (the control plane hands this peer's part of a run off,
     gossip announces the leave), tell every peer we are leaving, close the transport, cancel
     everything, return.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from dtfm.net import Address, Identity, Transport, pack

from .config import DaemonConfig, ListenError
from .discovery import Discovery
from .loopwatch import LoopWatch
from .paths import DataDir
from .socket import ControlServer
from .procmem import process_memory
from .status import CORE_KEYS, REPLY_OVERHEAD_BYTES, fit_report

logger = logging.getLogger(__name__)

Service = Callable[..., Awaitable[None]]   # async def svc(daemon, *, task_status)
StatusProvider = Callable[[], object]


class Daemon:
    def __init__(self, config: DaemonConfig, identity: "Identity", transport: "Transport",
                 data_dir: DataDir, *, rng: random.Random | None = None):
        self.config = config
        self.identity = identity
        self.transport = transport
        self.data_dir = data_dir
        self.discovery = Discovery(transport, config.discovery,
                                   rng=random.Random() if rng is None else rng)
        self.socket = ControlServer(data_dir.control_socket, config.socket)
        self.socket.register("status", self._op_status)
        self.socket.register("leave", self._op_leave)
        self.loop_watch = LoopWatch()
        self.listen_address: Address | None = None
        self.started_at: float | None = None
        self._services: list[tuple[str, Service]] = []
        self._providers: dict[str, StatusProvider] = {}
        self._leave_reason: str | None = None
        self._leave = trio.Event()
        self._leave_hooks: list[tuple[str, Callable[[], Awaitable[None]]]] = []

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
        label = name if name else str(getattr(service, "__qualname__", repr(service)))
        self._services.append((label, service))

    def add_status_provider(self, name: str, provider: StatusProvider) -> None:
        """Add `name: provider()` to every status report (a msgpack-able value)."""
        if name in CORE_KEYS or name in self._providers:
            raise ValueError(f"status field {name!r} is already taken")
        self._providers[name] = provider

    def add_control_op(self, op: str, handler: Callable[[dict], Awaitable[Any]]) -> None:
        """Answer control requests `op` with `await handler(args)`."""
        self.socket.register(op, handler)

    def add_leave_hook(self, hook: Callable[[], Awaitable[None]], *, name: str) -> None:
        """Run `await hook()` when the daemon leaves, before it says goodbye and closes the
        transport, in the order added; each bounds its own wait (an exception is logged)."""
        self._leave_hooks.append((name, hook))

    def request_leave(self, reason: str = "leaving") -> None:
        """Start a clean exit (idempotent)."""
        if self._leave_reason is None:
            self._leave_reason = reason
            logger.info("leaving the swarm: %s", reason)
        self._leave.set()

    # ---- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED) -> None:
        listen = self.config.peer.listen
        async with trio.open_nursery() as nursery:
            await nursery.start(self.loop_watch.run)
            try:
                host, port = await nursery.start(self.transport.serve, listen.host, listen.port)
            except OSError as e:
                raise ListenError(f"cannot listen on {listen}: {e.strerror or e}") from None
            self.listen_address = Address(host, port)
            self.discovery.start_advertising(self.listen_address, self.config.peer.advertise,
                                             self.config.peer.bootstrap)
            self.started_at = trio.current_time()
            await nursery.start(self.socket.serve)
            logger.info("peer %s listening on %s region=%s control=%s", self.short_id,
                        self.listen_address, self.config.peer.region or "-",
                        self.data_dir.control_socket)
            for name, service in self._services:
                logger.debug("starting service %s", name)
                await nursery.start(service, self)
            await nursery.start(self.discovery.run, self.config.peer.bootstrap,
                                self.listen_address)
            task_status.started(self.listen_address)
            await self._leave.wait()
            for name, hook in self._leave_hooks:
                try:
                    await hook()
                except Exception as e:
                    logger.warning("leave hook %s failed: %s: %s", name, type(e).__name__, e)
            await self.discovery.say_goodbye(self._leave_reason or "leaving")
            with trio.move_on_after(self.config.discovery.leave_timeout_s) as scope:
                scope.shield = True
                await self.transport.aclose()
            nursery.cancel_scope.cancel()
        logger.info("left the swarm")

    # ---- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        peers = []
        for entry in sorted(self.discovery.book.connected_peers(), key=lambda e: e.peer_id):
            conn = self.transport.connection(entry.peer_id)
            last_seen = conn.last_seen if conn is not None else now
            peers.append({
                "peer_id": entry.peer_id.hex(), "short_id": entry.peer_id[:4].hex(),
                "address": str(entry.address), "region": entry.region,
                "last_seen_s_ago": max(0.0, now - last_seen),
                "connected_for_s": max(0.0, now - (entry.connected_since or now)),
                "payload_bytes_sent": conn.payload_bytes_sent if conn is not None else 0,
                "payload_bytes_received": conn.payload_bytes_received if conn is not None else 0,
            })
        departed = [{
            "peer_id": d.peer_id.hex(), "short_id": d.peer_id[:4].hex(),
            "address": str(d.address), "region": d.region, "left_s_ago": max(0.0, now - d.at),
            "reason": d.reason} for d in reversed(self.discovery.book.departed.values())]
        advertised = self.discovery.advertised
        report: dict[str, Any] = {
            "peer_id": self.peer_id.hex(), "short_id": self.short_id,
            "listen": str(self.listen_address),
            "advertise": None if advertised is None else str(advertised),
            "region": self.config.peer.region,
            "pid": os.getpid(), "data_dir": str(self.data_dir.root),
            "uptime_s": now - (self.started_at if self.started_at is not None else now),
            "peers": peers, "departed": departed,
            "refused": self.transport.refusals.to_wire(),
            "memory": process_memory().to_wire(),
            "loop": self.loop_watch.status(),
        }
        for name, provider in self._providers.items():
            report[name] = _provided(name, provider)
        return report

    async def _op_status(self, args: dict) -> dict[str, Any]:
        return fit_report(self.status(), self.config.socket.max_response_bytes - REPLY_OVERHEAD_BYTES)

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

