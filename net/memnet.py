"""In-memory network with the shape of `dtfm.net.transport` (Transport, Connection), for
many gossip nodes in one process under trio's MockClock.

Frames go through msgpack both ways (so the wire dataclasses are exercised) and cross a
per-direction link model: FIFO serialisation at the link's bandwidth, then its one-way delay.
Frames can be dropped (a fraction of droppable ones, or everything on a cut link), and a node
can stall (it neither reads nor sends until a given time) or be killed.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Awaitable, Callable

import trio

from .errors import ConnectionClosed, ProtocolError, RequestTimeout
from .wire import pack, unpack_untrusted

__all__ = ["MemNetwork", "MemTransport", "MemConnection", "Reply"]

logger = logging.getLogger(__name__)

FRAME_OVERHEAD = 32  # header + AEAD tag, roughly what the real transport adds per frame
MAX_FRAME = 16 * 1024 * 1024


@dataclass(frozen=True)
class Reply:
    body: object
    payload: bytes | None = None


LinkModel = Callable[[str, str], tuple[float, float]]  # (src region, dst region) -> (delay_s, bps)


def uniform_link(delay_s: float = 0.001, bps: float = 1e9) -> LinkModel:
    return lambda a, b: (delay_s, bps)


def scenario_link(scenario, time_scale: float = 1.0) -> LinkModel:
    """Links of a `dtfm.scenarios.Scenario`: one-way ms and Gbps per region pair."""
    def model(a: str, b: str) -> tuple[float, float]:
        delay_ms, gbps = scenario.link(a, b)
        return delay_ms / 1000.0 * time_scale, gbps * 1e9 / time_scale
    return model


class MemNetwork:
    def __init__(self, link: LinkModel | None = None, *, drop_fraction: float = 0.0,
                 seed: int = 0) -> None:
        self.link = link or uniform_link()
        self.drop_fraction = drop_fraction
        self._rng = random.Random(seed)
        self.nodes: dict[bytes, MemTransport] = {}
        self.by_address: dict[tuple[str, int], MemTransport] = {}
        self.cut: set[tuple[bytes, bytes]] = set()
        self.bytes_sent: dict[bytes, int] = defaultdict(int)
        self.frames_sent: dict[bytes, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.bytes_by_type: dict[int, int] = defaultdict(int)
        self._busy_until: dict[tuple[bytes, bytes], float] = {}
        self._heap: list = []
        self._count = itertools.count()
        self._wake = trio.Event()
        self._ports = itertools.count(10000)

    def add(self, peer_id: bytes, region: str = "") -> "MemTransport":
        t = MemTransport(self, peer_id, region, ("mem", next(self._ports)))
        self.nodes[peer_id] = t
        self.by_address[t.listen_address] = t
        return t

    def cut_link(self, a: bytes, b: bytes, *, both: bool = True) -> None:
        self.cut.add((a, b))
        if both:
            self.cut.add((b, a))

    def heal(self) -> None:
        self.cut.clear()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Deliver frames when due. Run it in the nursery that holds the nodes."""
        task_status.started()
        while True:
            if not self._heap:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            due = self._heap[0][0]
            if due > trio.current_time():
                with trio.move_on_at(due):
                    await self._wake.wait()
                    self._wake = trio.Event()
                continue
            _, _, dst, frame = heapq.heappop(self._heap)
            node = self.nodes.get(dst)
            if node is not None and not node.killed:
                node._arrive(frame)

    def _transmit(self, src: "MemTransport", dst: bytes, frame: tuple, size: int,
                  droppable: bool) -> None:
        self.bytes_sent[src.peer_id] += size
        self.frames_sent[src.peer_id][frame[2]] += 1
        self.bytes_by_type[frame[2]] += size
        target = self.nodes.get(dst)
        if target is None or target.killed or (src.peer_id, dst) in self.cut:
            return
        if droppable and self.drop_fraction and self._rng.random() < self.drop_fraction:
            return
        delay_s, bps = self.link(src.region, target.region)
        now = trio.current_time()
        start = max(now, self._busy_until.get((src.peer_id, dst), now))
        done = start + (size * 8 / bps if math.isfinite(bps) and bps > 0 else 0.0)
        self._busy_until[(src.peer_id, dst)] = done
        heapq.heappush(self._heap, (done + delay_s, next(self._count), dst, frame))
        self._wake.set()


Handler = Callable[["MemConnection", int, object, bytes | None], Awaitable[object | None]]


class MemTransport:
    """One node's end of a MemNetwork, with the Transport API."""

    def __init__(self, net: MemNetwork, peer_id: bytes, region: str, address: tuple[str, int]) -> None:
        self.net = net
        self.peer_id = peer_id
        self.region = region
        self.listen_address = address
        self.killed = False
        self.stalled_until = -math.inf
        self._handlers: dict[int, Handler] = {}
        self._conns: dict[bytes, MemConnection] = {}
        self._on_connect: list = []
        self._on_disconnect: list = []
        self._inbox_send, self._inbox = trio.open_memory_channel(4096)
        self._req_ids = itertools.count(1)
        self._pending: dict[int, list] = {}

    # Transport API

    def handle(self, msg_type: int, handler: Handler) -> None:
        self._handlers[msg_type] = handler

    def on_connect(self, cb) -> None:
        self._on_connect.append(cb)

    def on_disconnect(self, cb) -> None:
        self._on_disconnect.append(cb)

    async def connect(self, host: str, port: int) -> "MemConnection":
        await trio.lowlevel.checkpoint()
        other = self.net.by_address.get((host, port))
        if other is None or other.killed or (self.peer_id, other.peer_id) in self.net.cut:
            raise ConnectionClosed(f"cannot connect to {host}:{port}")
        return self._conn(other.peer_id)

    def connection(self, peer_id: bytes) -> "MemConnection | None":
        return self._conns.get(peer_id)

    def connections(self) -> list["MemConnection"]:
        return list(self._conns.values())

    # internals

    def _conn(self, peer_id: bytes) -> "MemConnection":
        c = self._conns.get(peer_id)
        if c is None:
            other = self.net.nodes[peer_id]
            c = self._conns[peer_id] = MemConnection(self, other)
            for cb in self._on_connect:
                cb(c)
        return c

    def kill(self) -> None:
        self.killed = True

    def _arrive(self, frame: tuple) -> None:
        try:
            self._inbox_send.send_nowait(frame)
        except trio.WouldBlock:
            logger.warning("%s: inbox full, dropping a frame", self.peer_id[:4].hex())

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Read frames and run handlers, one at a time."""
        task_status.started()
        async for frame in self._inbox:
            if trio.current_time() < self.stalled_until:
                await trio.sleep_until(self.stalled_until)
            if self.killed:
                return
            await self._dispatch(frame)

    async def _dispatch(self, frame: tuple) -> None:
        src, kind, msg_type, req_id, data, payload = frame
        conn = self._conn(src)
        try:
            body = unpack_untrusted(data, max_len=MAX_FRAME)
        except ProtocolError:
            return
        if kind == "reply":
            slot = self._pending.pop(req_id, None)
            if slot is not None:
                slot[1] = (body, payload)
                slot[0].set()
            return
        handler = self._handlers.get(msg_type)
        if handler is None:
            return
        try:
            result = await handler(conn, msg_type, body, payload)
        except ProtocolError as e:
            logger.debug("%s: bad message %d from %s: %s", self.peer_id[:4].hex(), msg_type,
                         src[:4].hex(), e)
            return
        if kind == "request":
            reply = result if isinstance(result, Reply) else Reply(result)
            await conn._frame("reply", msg_type, req_id, reply.body, reply.payload, False)


class MemConnection:
    def __init__(self, local: MemTransport, remote: MemTransport) -> None:
        self._local = local
        self.peer_id = remote.peer_id
        self.short_id = remote.peer_id[:4].hex()
        self.region = remote.region
        self.listen_address = remote.listen_address
        self.remote_address = remote.listen_address
        self.last_seen = 0.0

    async def _frame(self, kind: str, msg_type: int, req_id: int, body, payload, droppable: bool) -> None:
        local = self._local
        if local.killed:
            raise ConnectionClosed("transport closed")
        if trio.current_time() < local.stalled_until:
            await trio.sleep_until(local.stalled_until)
        data = pack(body)
        size = FRAME_OVERHEAD + len(data) + (len(payload) if payload else 0)
        frame = (local.peer_id, kind, msg_type, req_id, data, payload)
        local.net._transmit(local, self.peer_id, frame, size, droppable)
        await trio.lowlevel.checkpoint()

    async def send(self, msg_type: int, body, *, payload: bytes | None = None,
                   droppable: bool = False) -> None:
        await self._frame("send", msg_type, 0, body, payload, droppable)

    async def request(self, msg_type: int, body, *, payload: bytes | None = None,
                      timeout_s: float | None = None) -> tuple[object, bytes | None]:
        req_id = next(self._local._req_ids)
        slot = [trio.Event(), None]
        self._local._pending[req_id] = slot
        try:
            with trio.move_on_after(math.inf if timeout_s is None else timeout_s):
                await self._frame("request", msg_type, req_id, body, payload, False)
                await slot[0].wait()
                return slot[1]
            raise RequestTimeout(f"no reply from {self.short_id} within {timeout_s} s")
        finally:
            self._local._pending.pop(req_id, None)

    async def close(self, reason: str = "") -> None:
        self._local._conns.pop(self.peer_id, None)
        await trio.lowlevel.checkpoint()
