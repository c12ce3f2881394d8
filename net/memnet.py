"""An in-memory network of `MemTransport`s, for many peers in one process under trio's
MockClock.

Frames cross a per-direction link model: FIFO serialisation at the link's bandwidth, then its
one-way delay. Frames can be dropped (a fraction of the droppable ones, or everything on a cut
link); a node can stall (it neither reads nor sends until a given time) or be killed.

    net = MemNetwork(uniform_link(0.01, 1e9), config=TransportConfig.test())
    a, b = net.add(id_a, "eu"), net.add(id_b, "us")
    await nursery.start(net.run)
    await nursery.start(a.serve)
    await nursery.start(b.serve)
    conn = await a.connect(*b.listen_address)
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from .config import TransportConfig
from .memtransport import CLOSE, MemFrame, MemTransport

if TYPE_CHECKING:
    from dtfm.scenarios import Scenario

__all__ = ["LinkModel", "MemNetwork", "scenario_link", "uniform_link"]

LinkModel = Callable[[str, str], tuple[float, float]]  # (src region, dst region) -> (delay_s, bps)


def uniform_link(delay_s: float = 0.001, bps: float = 1e9) -> LinkModel:
    return lambda a, b: (delay_s, bps)


def scenario_link(scenario: Scenario, time_scale: float = 1.0) -> LinkModel:
    """Links of a `dtfm.scenarios.Scenario`: one-way ms and Gbps per region pair."""
    def model(a: str, b: str) -> tuple[float, float]:
        delay_ms, gbps = scenario.link(a, b)
        return delay_ms / 1000.0 * time_scale, gbps * 1e9 / time_scale
    return model


class MemNetwork:
    """The links between in-memory transports; `run()` delivers frames when they are due."""

    def __init__(self, link: LinkModel | None = None, *, drop_fraction: float = 0.0,
                 seed: int = 0, config: TransportConfig | None = None) -> None:
        self.link = link or uniform_link()
        self.drop_fraction = drop_fraction
        self.config = config or TransportConfig.default()  # for every transport added
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
        self.link_ids = itertools.count(1)  # one per connection, shared by its two ends

    def add(self, peer_id: bytes, region: str = "") -> MemTransport:
        """A new node; a peer id added again (a restart) gets a new address. Each node has a
        host of its own, as peers on separate machines do (gossip admits members per host)."""
        port = next(self._ports)
        t = MemTransport(self, peer_id, region, (f"mem{port - 10000}", port), self.config)
        self.nodes[peer_id] = t
        self.by_address[t.listen_address] = t
        return t

    def cut_link(self, a: bytes, b: bytes, *, both: bool = True) -> None:
        """Lose every frame from a to b (and b to a) until `heal()`; connections stay open."""
        self.cut.add((a, b))
        if both:
            self.cut.add((b, a))

    def heal(self) -> None:
        self.cut.clear()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
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
            if not dst.killed:
                dst._arrive(frame)

    def transmit(self, src: MemTransport, dst: MemTransport, frame: MemFrame, size: int) -> None:
        """Put a frame of `size` bytes on the link from src to dst (or lose it)."""
        self.bytes_sent[src.peer_id] += size
        if frame.kind != CLOSE:
            self.frames_sent[src.peer_id][frame.msg_type] += 1
            self.bytes_by_type[frame.msg_type] += size
        if dst.killed or (src.peer_id, dst.peer_id) in self.cut:
            return
        if frame.droppable and self.drop_fraction and self._rng.random() < self.drop_fraction:
            return
        delay_s, bps = self.link(src.region, dst.region)
        now = trio.current_time()
        key = (src.peer_id, dst.peer_id)
        start = max(now, self._busy_until.get(key, now))
        done = start + (size * 8 / bps if math.isfinite(bps) and bps > 0 else 0.0)
        self._busy_until[key] = done
        heapq.heappush(self._heap, (done + delay_s, next(self._count), dst, frame))
        self._wake.set()
