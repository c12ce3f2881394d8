"""Many gossip nodes in one process over a MemNetwork, for tests and benchmarks under trio's
MockClock (`MockClock(autojump_threshold=0)` runs an hour of gossip in seconds).

    async with trio.open_nursery() as nursery:
        h = Harness(16, GossipConfig.lan(), seed=1)
        await h.start(nursery)
        ...
        h.kill(3)
"""

from __future__ import annotations

import functools
import random
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable

import trio

from dtfm.net import Identity, LinkModel, MemNetwork, MemTransport, scenario_link

from .config import GossipConfig
from .measure import compute_speed_ms
from .members import Member, MemberState
from .service import GossipService

if TYPE_CHECKING:
    from dtfm.scenarios import Scenario

__all__ = ["Harness", "WALL_EPOCH"]

WALL_EPOCH = 1.8e9  # wall-clock seconds at virtual time 0


class Harness:
    def __init__(self, n: int, config: GossipConfig, *, regions: list[str] | None = None,
                 link: LinkModel | None = None, scenario: Scenario | None = None, time_scale: float = 1.0,
                 drop_fraction: float = 0.0, seed: int = 0, measure: bool = False,
                 compute_ms: float = 1.0, codec_probe: Callable[[int], Sequence[float]] | None = None,
                 compute_probe: Callable[[int], float] | None = None) -> None:
        """codec_probe(k): node k's coding-speed probe (run in a worker thread at its start, as
        the daemon's is); None: the nodes report none. compute_probe(k): node k's compute-speed
        probe, run the same way when `measure` (instead of the given `compute_ms`)."""
        if scenario is not None:
            regions = scenario.peer_regions()
            link = scenario_link(scenario, time_scale)
            n = len(regions)
        self.n = n
        self.config = config
        self.regions = regions or [""] * n
        self.net = MemNetwork(link, drop_fraction=drop_fraction, seed=seed)
        self._rng = random.Random(seed)
        self._measure = measure
        self._compute_ms = compute_ms
        self._codec_probe = codec_probe
        self._compute_probe = compute_probe
        self.identities = [Identity(self._rng.randbytes(32)) for _ in range(n)]
        self.ids = [i.peer_id for i in self.identities]
        self.index = {p: k for k, p in enumerate(self.ids)}
        self.transports: list[MemTransport] = []
        self.services: list[GossipService] = []
        self._scopes: list[trio.CancelScope] = []
        self._full_cache: dict[tuple[bytes, int], bool] = {}
        # (observer, subject) -> [(virtual time, state)]: every state change each node saw
        self.history: dict[tuple[int, int], list[tuple[float, MemberState]]] = defaultdict(list)

    def wall(self) -> float:
        return WALL_EPOCH + trio.current_time()

    async def start(self, nursery: trio.Nursery, *, join: bool = True) -> None:
        self._nursery = nursery
        await nursery.start(self.net.run)
        for k in range(self.n):
            await self._start_node(nursery, k)
        if join:
            for k in range(1, self.n):
                await self.services[k].join([self.transports[0].listen_address])

    async def _start_node(self, nursery: trio.Nursery, k: int) -> None:
        t = self.net.add(self.ids[k], self.regions[k])
        svc = GossipService(t, self.identities[k], self.config, region=self.regions[k],
                            rng=random.Random(self._rng.random()), wall_clock=self.wall,
                            compute_ms=self._compute_ms if self._compute_probe is None else None, measure=self._measure,
                            codec_probe=None if self._codec_probe is None else functools.partial(self._codec_probe, k),
                            compute_probe=(compute_speed_ms if self._compute_probe is None
                                           else functools.partial(self._compute_probe, k)))
        svc.on_member_change(functools.partial(self._observe, k))
        scope = trio.CancelScope()
        if k < len(self.transports):  # a restart
            self.transports[k], self.services[k], self._scopes[k] = t, svc, scope
        else:
            self.transports.append(t)
            self.services.append(svc)
            self._scopes.append(scope)
        await nursery.start(self._run_node, t, svc, scope)

    @staticmethod
    async def _run_node(t: MemTransport, svc: GossipService, scope: trio.CancelScope, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            async with trio.open_nursery() as inner:
                await inner.start(t.serve)
                await inner.start(svc.run)
                task_status.started()

    def _observe(self, k: int, m: Member) -> None:
        j = self.index.get(m.peer_id)
        if j is not None:
            self.history[(k, j)].append((trio.current_time(), m.state))

    def kill(self, k: int) -> None:
        self.transports[k].kill()
        self._scopes[k].cancel()

    async def restart(self, k: int, via: int = 0) -> None:
        """Start node k again with the same identity (a new address) and rejoin via `via`."""
        self.kill(k)
        await self._start_node(self._nursery, k)
        await self.services[k].join([self.transports[via].listen_address])

    def stall(self, k: int, duration_s: float) -> None:
        """Node k neither reads nor sends for duration_s (a long GC pause, a frozen VM)."""
        self.transports[k].stalled_until = trio.current_time() + duration_s

    def state_seen(self, observer: int, subject: int) -> MemberState | None:
        m = self.services[observer].swim.members.get(self.ids[subject])
        return m.state if m else None

    def alive_nodes(self) -> list[int]:
        return [k for k in range(self.n) if not self.transports[k].killed]

    def first_time(self, observer: int, subject: int, state: MemberState) -> float | None:
        for t, s in self.history[(observer, subject)]:
            if s == state:
                return t
        return None

    def all_know_all(self) -> bool:
        live = self.alive_nodes()
        return all(self.services[k].swim.live_count() == len(live) for k in live)

    def complete_views(self) -> int:
        """Nodes whose view holds a measured latency and bandwidth for every live pair."""
        count = 0
        for k in self.alive_nodes():
            v = self.services[k].view()
            n = len(v.peers)
            count += n == len(self.alive_nodes()) and int(v.measured().sum()) == n * (n - 1)
        return count

    def ready_views(self) -> int:
        """Nodes whose view has a figure, measured or estimated, for every live pair (what
        the scheduler needs)."""
        return sum(1 for k in self.alive_nodes() if self.services[k].view().complete
                   and len(self.services[k].view().peers) == len(self.alive_nodes()))

    def full_rows(self) -> int:
        """Nodes that hold, from every live peer, a report with a full row (latency and
        bandwidth to every other live peer): a complete matrix measured from both ends.
        Cheap enough to poll at 512 peers."""
        live = self.alive_nodes()
        want = len(live) - 1
        count = 0
        for k in live:
            reports = self.services[k].records.reports
            if len(reports) < len(live):
                continue
            ok = True
            for r in reports.values():
                key = (r.measurer, r.seq)
                full = self._full_cache.get(key)
                if full is None:
                    full = self._full_cache[key] = (len(r.entries) >= want and
                                                    all(e.bandwidth_gbps > 0 for e in r.entries))
                if not full:
                    ok = False
                    break
            count += ok
        return count

    def bytes_sent(self) -> int:
        return sum(self.net.bytes_sent.values())

    def frames_sent(self, k: int | None = None) -> int:
        keys = [self.ids[k]] if k is not None else self.ids
        return sum(sum(self.net.frames_sent[p].values()) for p in keys)
