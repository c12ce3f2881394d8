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
import statistics
import sys
import time

import trio
import trio.testing

from dtfm.gossip.config import GossipConfig
from dtfm.gossip.harness import Harness
from dtfm.gossip.members import MemberState
from dtfm.gossip.messages import MsgType
from dtfm.gossip.simulator import SwimSimulator
from dtfm.sched.scenario import load_scenario

MEASURE_TYPES = (MsgType.MEASURE_PING, MsgType.MEASURE_BULK)
CONFIG = GossipConfig.lan().with_(bandwidth_probe_bytes=256 * 1024, bandwidth_probe_interval_s=0.1,
                                  rtt_samples=3, rtt_ping_spacing_s=0.0, publish_interval_s=2.0,
                                  record_sync_interval_s=1.0)


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
    ap.add_argument("--sizes", default="16,64,256,512")
    ap.add_argument("--scenario", default="worldwide")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steady-s", type=float, default=30.0)
    ap.add_argument("--limit-s", type=float, default=3600.0, help="simulated seconds per size")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    results = []
    for n in sizes:
        wall = time.perf_counter()
        r = trio.run(run_swarm, n, args.scenario, args.seed, args.steady_s, args.limit_s,
                     clock=trio.testing.MockClock(autojump_threshold=0))
        r.update(change_dissemination(n))
        r["wall_s"] = time.perf_counter() - wall
        results.append(r)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
              file=sys.stderr, flush=True)
    print(json.dumps({"bench": "gossip", "scenario": args.scenario, "config": {
        "probe_interval_s": CONFIG.probe_interval_s, "record_sync_interval_s": CONFIG.record_sync_interval_s,
        "bandwidth_probe_bytes": CONFIG.bandwidth_probe_bytes, "rtt_samples": CONFIG.rtt_samples},
        "results": results}))


if __name__ == "__main__":
    main()
