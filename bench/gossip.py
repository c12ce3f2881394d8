"""Gossip at scale under MockClock: N peers on a scaled scenario, in one process.

For each N: simulated seconds (and probe rounds) until membership has converged, until every
peer has measured every other, and until every peer holds every peer's full row (the
complete N x N matrix from both ends); bytes sent per peer per second, during convergence and
in steady state, split into gossip (membership + record anti-entropy) and measurement probes;
and, from the discrete-event SWIM simulator, the gossip intervals a membership change takes
to reach every peer.

    .venv/bin/python bench/gossip.py                   # N = 16, 64, 256, 512
    .venv/bin/python bench/gossip.py --sizes 16,64     # quicker

Prints one line per N and, last, one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import trio
import trio.testing

from dtfm.gossip.config import GossipConfig
from dtfm.gossip.harness import Harness
from dtfm.gossip.members import MemberState
from dtfm.gossip.messages import MsgType
from dtfm.gossip.records import Entry, RecordStore, Report
from dtfm.gossip.simulator import SwimSimulator
from dtfm.scenarios import load_scenario

MEASURE_TYPES = (MsgType.MEASURE_PING, MsgType.MEASURE_BULK)
# All-pairs measurement (every link measured, reports of N - 1 links): what this bench has
# always measured; bench/gossip_scale.py measures the sampled design against it.
CONFIG = GossipConfig.lan().with_(bandwidth_probe_bytes=256 * 1024, bandwidth_probe_interval_s=0.1,
                                  rtt_samples=3, rtt_ping_spacing_s=0.0, publish_interval_s=2.0,
                                  record_sync_interval_s=1.0, full_mesh_max_peers=1024, max_report_links=1024)


def split_bytes(h: Harness) -> tuple[int, int]:
    by = h.net.bytes_by_type
    measure = sum(by[t] for t in MEASURE_TYPES)
    return sum(by.values()) - measure, measure


async def run_swarm(n: int, scenario_name: str, seed: int, steady_s: float, limit_s: float) -> dict:
    scenario = load_scenario(scenario_name).scaled(n)
    out: dict = {"n": n}
    async with trio.open_nursery() as nursery:
        h = Harness(n, CONFIG, scenario=scenario, seed=seed, measure=True)
        t0 = trio.current_time()
        await h.start(nursery)
        while trio.current_time() - t0 < limit_s:
            await trio.sleep(1.0)
            now = trio.current_time() - t0
            if "membership_s" not in out and h.all_know_all():
                out["membership_s"] = now
            if "measured_s" not in out and all(
                    sum(1 for e in s.planner.entries() if e.bandwidth_gbps > 0) == n - 1 for s in h.services):
                out["measured_s"] = now
            if "measured_s" in out and h.full_rows() == n:
                out["complete_s"] = now
                break
        else:
            out["complete_s"] = None
        elapsed = trio.current_time() - t0
        gossip, measure = split_bytes(h)
        out["converge_gossip_Bps_per_peer"] = gossip / n / elapsed
        out["converge_measure_Bps_per_peer"] = measure / n / elapsed
        g0, m0 = gossip, measure
        await trio.sleep(steady_s)
        gossip, measure = split_bytes(h)
        out["steady_gossip_Bps_per_peer"] = (gossip - g0) / n / steady_s
        out["steady_measure_Bps_per_peer"] = (measure - m0) / n / steady_s
        nursery.cancel_scope.cancel()
    if out.get("complete_s") is not None:
        out["complete_rounds"] = out["complete_s"] / CONFIG.probe_interval_s
        out["dissemination_s"] = out["complete_s"] - out["measured_s"]
        out["dissemination_rounds"] = out["dissemination_s"] / CONFIG.record_sync_interval_s
    return out


def record_dissemination(n: int, seed: int, interval_s: float) -> dict:
    """Rounds of record anti-entropy until every peer holds all n rows, all rows new at
    round 0 (the dissemination after the last measurement), with the protocol of
    GossipService._on_sync (hash, digest, reports) on real RecordStores; signatures are
    skipped here (they are tested elsewhere) and bytes are counted from wire sizes."""
    rng = random.Random(seed)
    ids = [rng.randbytes(32) for _ in range(n)]
    entries = tuple(Entry(t, 1.0, 1.0, 3) for t in ids[1:])  # a full row's size
    stores = []
    for pid in ids:
        st = RecordStore(skew_s=600, verify=lambda r: True)
        st.offer(Report(pid, 1, 0.0, 1.0, entries), now_wall=0.0, is_member=lambda p: True)
        stores.append(st)
    digest_item = 32 + 9 + 2
    sent = 0
    rounds = 0
    while not all(len(st.reports) == n for st in stores):
        rounds += 1
        for a in rng.sample(range(n), n):
            b = rng.choice([k for k in (rng.randrange(n), rng.randrange(n)) if k != a] or [(a + 1) % n])
            A, B = stores[a], stores[b]
            sent += 40
            if A.digest_hash() == B.digest_hash():
                continue
            to_a = B.newer_than(A.digest(), CONFIG.max_sync_bytes)  # phase 1 digest -> phase 2
            to_b = A.newer_than(B.digest(), CONFIG.max_sync_bytes)
            sent += 2 * digest_item * n + sum(r.wire_size for r in to_a + to_b)
            for r in to_b:
                B.offer(r, now_wall=0.0, is_member=lambda p: True)
            for r in to_a:
                A.offer(r, now_wall=0.0, is_member=lambda p: True)
    return {"records_rounds": rounds, "records_s": rounds * interval_s,
            "records_Bps_per_peer": sent / n / (rounds * interval_s)}


def membership_steady(n: int, seed: int, window_s: float = 60.0) -> dict:
    """Membership traffic alone at steady state (SWIM simulator, exact wire bytes)."""
    s = SwimSimulator(n, GossipConfig.lan(), seed=seed, join_spread_s=2.0)
    s.run_until(30.0)
    converged = all(s.nodes[k].live_count() == n for k in range(n))
    b0, f0 = sum(s.bytes), sum(s.frames)
    s.run_until(30.0 + window_s)
    return {"membership_converged": converged,
            "membership_Bps_per_peer": (sum(s.bytes) - b0) / n / window_s,
            "membership_msgs_per_peer_s": (sum(s.frames) - f0) / n / window_s}


def change_dissemination(n: int, seeds: int = 5) -> dict:
    """Gossip intervals until a leave reaches every peer (memberlist LAN profile)."""
    lan = GossipConfig.lan()
    worst = []
    for seed in range(seeds):
        s = SwimSimulator(n, lan, seed=seed, codec=False, join_spread_s=2.0)
        s.run_until(20.0)
        s.leave(n - 1)
        s.run_until(60.0)
        times = [s.first_time(k, n - 1, MemberState.LEFT) for k in range(n - 1)]
        worst.append((max(t for t in times if t is not None) - 20.0) / lan.gossip_interval_s)
    return {"n": n, "change_intervals_median": statistics.median(worst), "change_intervals_max": max(worst)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,64,256,512",
                    help="sizes for the membership and record-dissemination figures")
    ap.add_argument("--full-sizes", default="16,64",
                    help="sizes run end to end (every service, measurement, crypto) in the harness")
    ap.add_argument("--scenario", default="worldwide")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steady-s", type=float, default=30.0)
    ap.add_argument("--limit-s", type=float, default=3600.0, help="simulated seconds per size")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    full = [int(x) for x in args.full_sizes.split(",") if x]
    results = []
    for n in sorted(set(sizes) | set(full)):
        wall = time.perf_counter()
        r: dict = {"n": n}
        if n in sizes:
            r.update(membership_steady(n, args.seed))
            r.update(change_dissemination(n))
            r.update(record_dissemination(n, args.seed, CONFIG.record_sync_interval_s))
        if n in full:
            r["full"] = trio.run(run_swarm, n, args.scenario, args.seed, args.steady_s, args.limit_s,
                                 clock=trio.testing.MockClock(autojump_threshold=0))
        r["wall_s"] = time.perf_counter() - wall
        results.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    print(json.dumps({"bench": "gossip", "scenario": args.scenario, "config": {
        "probe_interval_s": CONFIG.probe_interval_s, "record_sync_interval_s": CONFIG.record_sync_interval_s,
        "bandwidth_probe_bytes": CONFIG.bandwidth_probe_bytes, "rtt_samples": CONFIG.rtt_samples},
        "results": results}))


if __name__ == "__main__":
    main()
