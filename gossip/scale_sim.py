"""Discrete-event simulation of measurement and record dissemination at scale (1,000 peers
in minutes of CPU), on top of `SwimSimulator`'s membership.

Each simulated peer runs the service's own decision code: its `Swim`, a `MeasurePlanner`
(what to measure next), a `Vivaldi` coordinate, `report_due` (when to sign a new report),
real signed `Report`s in a `RecordStore`, and a `RecordSyncer` whose messages go through
their codecs (the record bytes counted are exact). What is modelled instead of run is the
probes themselves: a round trip takes twice the scenario's one-way delay (plus a little
noise), a timed transfer the scenario's bandwidth, and their bytes are counted as the probes
would send them. Every message crosses the scenario's one-way delay between the two peers'
regions.

    sim = MeasureSimulator(scenario.scaled(1000), GossipConfig.wan(), seed=1)
    sim.run_until(120.0)
    sim.view(0).complete              # the coordinator's (node 0's) view, estimated where unmeasured
    sim.bytes_by_kind()               # {"swim": ..., "records": ..., "measure": ...} per node
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from dtfm.net import pack, unpack_untrusted

from .config import GossipConfig
from .measure import BulkProbe, JobKind, MeasurePing, MeasurePlanner, report_due
from .records import RecordStore, Report
from .simulator import FRAME_OVERHEAD, SwimSimulator
from .sync import RecordSync, RecordSyncer
from .view import NetworkView, build_view
from .vivaldi import Coordinate, Vivaldi

if TYPE_CHECKING:
    from dtfm.scenarios import Scenario

__all__ = ["MeasureSimulator", "WALL_EPOCH"]

WALL_EPOCH = 1.8e9  # wall-clock seconds at virtual time 0
RTT_NOISE = 0.02  # a round trip comes out up to this fraction longer than twice the delay


class _Peer:
    """One peer's measurement state (its Swim lives in the simulator's `nodes`)."""

    def __init__(self, config: GossipConfig, rng: random.Random, verify: Callable[[Report], bool]) -> None:
        self.planner = MeasurePlanner(config.remeasure_interval_s, config.bandwidth_probe_interval_s,
                                      config.measure_jitter, rng, full_mesh_max_peers=config.full_mesh_max_peers,
                                      capacity_peers=config.capacity_peers, coord_interval_s=config.coord_interval_s,
                                      confirm_fresh_s=config.confirm_fresh_s, max_report_links=config.max_report_links)
        self.vivaldi = Vivaldi(random.Random(rng.random()))
        self.store = RecordStore(config.record_skew_s, verify=verify)
        self.syncer = RecordSyncer(self.store, max_sync_bytes=config.max_sync_bytes,
                                   timeout_s=config.record_sync_timeout_s)
        self.rtt_seen: dict[bytes, float] = {}
        self.seq = 0
        self.published: Report | None = None
        self.published_at = float("-inf")
        self.published_version = -1


class MeasureSimulator(SwimSimulator):
    def __init__(self, scenario: Scenario, config: GossipConfig, *, seed: int = 0, join_spread_s: float = 10.0,
                 compute_ms: float = 1.0, codec: bool = True) -> None:
        """codec: every message through its decoder too (False: packed to count its bytes,
        then handed over as it is: several times faster, the same bytes)."""
        self.regions = scenario.peer_regions()
        n = len(self.regions)
        self.delay_ms = scenario.delay_ms()  # (N, N) one-way
        self.bandwidth_gbps = scenario.bandwidth_gbps()
        super().__init__(n, config, seed=seed, join_spread_s=join_spread_s, distinct_hosts=True,
                         codec=codec, count_bytes=True,
                         link_delay_s=lambda a, b: float(self.delay_ms[a, b]) / 1000.0)
        self.compute_ms = compute_ms
        self._verified: dict[tuple[bytes, int, bytes], bool] = {}  # one check per distinct report
        self.peers = [_Peer(config, random.Random(self.rng.random()), self._verify) for _ in range(n)]
        self.record_bytes = [0] * n
        self.measure_bytes = [0] * n
        self.reports_signed = 0
        self._live_cache: dict[int, tuple[tuple[int, int], list[bytes]]] = {}
        for k in range(n):
            self.push(self.rng.uniform(0, config.record_sync_interval_s), ("sync", k))
            self.push(self.rng.uniform(0, config.coord_interval_s), ("measure", k))

    def wall(self) -> float:
        return WALL_EPOCH + self.now

    def _verify(self, r: Report) -> bool:
        key = (r.measurer, r.seq, r.signature)
        ok = self._verified.get(key)
        if ok is None:
            ok = self._verified[key] = r.verify()
        return ok

    # ---- what the tests and the bench read

    def view(self, k: int, *, estimate: bool = True) -> NetworkView:
        """Node k's view over the members it counts as alive."""
        live = tuple(sorted(m.peer_id for m in self.nodes[k].live_members()))
        return build_view(live, self.peers[k].store.reports, estimate=estimate, now_wall=self.wall())

    def bytes_by_kind(self) -> dict[str, list[int]]:
        return {"swim": list(self.bytes), "records": list(self.record_bytes), "measure": list(self.measure_bytes)}

    def scenario_order(self, view: NetworkView) -> list[int]:
        return [self.index[p] for p in view.peers]

    def delay_error(self, view: NetworkView) -> float:
        """Median relative error of the view's one-way delays against the scenario's."""
        order = self.scenario_order(view)
        want = self.delay_ms[np.ix_(order, order)]
        off = ~np.eye(len(order), dtype=bool) & (want > 0)
        return float(np.median(np.abs(view.delay_ms[off] / want[off] - 1)))

    # ---- events

    def on_event(self, t: float, item: tuple) -> None:
        kind, k = item[0], item[1]
        if kind == "sync":
            self._sync_round(k, t)
        elif kind == "rsync":
            self._on_sync(k, item[2], item[3], t)
        elif kind == "measure":
            self._measure(k, t)
        else:
            super().on_event(t, item)

    def _live_others(self, k: int) -> list[bytes]:
        """The members node k counts as alive, but itself (cached while its counts hold)."""
        swim = self.nodes[k]
        key = (swim.live_count(), len(swim.members))
        held = self._live_cache.get(k)
        if held is None or held[0] != key:
            me = self.ids[k]
            held = self._live_cache[k] = (key, [m.peer_id for m in swim.live_members() if m.peer_id != me])
        return held[1]

    def _sync_round(self, k: int, t: float) -> None:
        cfg = self.config
        self.push(t + cfg.record_sync_interval_s * self.rng.uniform(0.5, 1.5), ("sync", k))
        self._publish(k, t)
        others = self._live_others(k)
        if not others:
            return
        peer = self.peers[k]
        peer.syncer.tick(t)
        dst = self.index[self.rng.choice(others)]
        self._send_sync(k, dst, peer.syncer.start(self.ids[dst], t))

    def _send_sync(self, k: int, dst: int, msg: RecordSync) -> None:
        data = pack(msg.to_wire())
        self.record_bytes[k] += len(data) + FRAME_OVERHEAD
        if dst in self.dead:
            return
        self.push(self.now + float(self.delay_ms[k, dst]) / 1000.0, ("rsync", dst, k, data if self.codec else msg))

    def _on_sync(self, k: int, src: int, data: bytes | RecordSync, t: float) -> None:
        msg = data if isinstance(data, RecordSync) else RecordSync.from_wire(unpack_untrusted(data, max_len=1 << 24))
        peer = self.peers[k]
        actions = peer.syncer.handle(self.ids[src], msg, t)
        swim = self.nodes[k]

        def is_member(p: bytes) -> bool:
            m = swim.members.get(p)
            return m is not None and not m.state.gone and swim.is_confirmed(p)

        for r in actions.accept:
            peer.store.offer(r, now_wall=self.wall(), is_member=is_member)
        if actions.reply is not None:
            self._send_sync(k, src, actions.reply)

    def _publish(self, k: int, t: float) -> None:
        peer, cfg = self.peers[k], self.config
        coord = peer.vivaldi.coord if peer.vivaldi.samples >= cfg.coord_min_samples else None
        scale = statistics.median(peer.rtt_seen.values()) if peer.rtt_seen else 1.0
        if not report_due(cfg, peer.planner, now=t, n_live=self.nodes[k].live_count(), coord=coord,
                          rtt_scale_ms=scale, last=peer.published, last_at=peer.published_at,
                          last_version=peer.published_version):
            return
        up, down = peer.planner.capacity(t)
        peer.published_version = peer.planner.version
        peer.published_at = t
        peer.seq = max(peer.seq + 1, int(self.wall() * 1000))
        report = Report.create(self.identities[k], peer.seq, self.wall(), self.compute_ms,
                               peer.planner.entries(t), coord=() if coord is None else coord.to_wire(),
                               up_gbps=up, down_gbps=down)
        peer.published = report
        self.reports_signed += 1
        self._verified[(report.measurer, report.seq, report.signature)] = True
        peer.store.offer(report, now_wall=self.wall(), is_member=lambda p: True)

    def _rtt_ms(self, a: int, b: int) -> float:
        return 2.0 * float(self.delay_ms[a, b]) * (1.0 + RTT_NOISE * self.rng.random()) + 0.05

    def _ping_bytes(self, coord: Coordinate) -> int:
        ask = len(pack(MeasurePing(0).to_wire()))
        answer = len(pack(MeasurePing(0, coord.to_wire()).to_wire()))
        return ask + answer + 2 * FRAME_OVERHEAD

    def _measure(self, k: int, t: float) -> None:
        """Node k's measurement loop: one job (as the service's `_run_job` would do it, the
        probes modelled), then the next wake-up."""
        peer, cfg = self.peers[k], self.config
        job = peer.planner.next_job(self._live_others(k), t)
        if job is None:
            self.push(max(peer.planner.wake_at(t), t + 1e-3), ("measure", k))
            return
        j = self.index[job.target]
        if j in self.dead:
            peer.planner.record(job.target, [], None, t)
            self.push(t + cfg.probe_interval_s, ("measure", k))
            return
        other = self.peers[j].vivaldi.coord
        samples = 1 if job.kind is JobKind.COORD else cfg.rtt_samples
        rtts = [self._rtt_ms(k, j) for _ in range(samples)]
        self.measure_bytes[k] += samples * self._ping_bytes(other)
        rtt_ms = statistics.median(rtts)
        peer.vivaldi.observe(job.target, other, rtt_ms)
        peer.rtt_seen.pop(job.target, None)
        peer.rtt_seen[job.target] = rtt_ms
        while len(peer.rtt_seen) > 256:
            del peer.rtt_seen[next(iter(peer.rtt_seen))]
        elapsed_s = (rtt_ms + cfg.rtt_ping_spacing_s * 1000 * (samples - 1)) / 1000.0
        if job.kind is JobKind.LINK:
            gbps = float(self.bandwidth_gbps[k, j])
            nbytes = cfg.bandwidth_probe_bytes
            control = len(pack(BulkProbe(0, nbytes).to_wire())) + 2 * FRAME_OVERHEAD + 40
            transfers = 2 if job.pull else 1
            self.measure_bytes[k] += transfers * (nbytes + 2 * control)
            elapsed_s += transfers * (2 * rtt_ms / 1000.0 + nbytes * 8 / (gbps * 1e9))
            peer.planner.record(job.target, [r / 1000.0 for r in rtts], gbps, t + elapsed_s,
                                gbps if job.pull else None)
        self.push(t + elapsed_s, ("measure", k))
