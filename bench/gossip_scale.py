"""Measurement at scale, simulated: 256 and 1,000 peers on the worldwide scenario under a
virtual clock (`dtfm.gossip.scale_sim.MeasureSimulator`: every peer's own Swim, measurement
planner, Vivaldi coordinate, report policy, signed reports and record anti-entropy; the probes
modelled on the scenario's links), against all-pairs measurement run the same way.

For each size: `view_ready_s`, virtual seconds from the start (peers joining through one
seed over the first 10 s) until the coordinator's (node 0's) view holds a figure for every
pair of the N peers, measured or estimated; how much of it was measured then, how far its
delays were from the scenario's, and the probe bytes each peer sent until then; then, after a settling time, the steady traffic per peer:
`gossip_kb_per_s_per_peer` (membership and record anti-entropy) and
`measure_kb_per_s_per_peer` (coordinate pings and capacity probes). The all-pairs baseline
(`full_mesh_max_peers` = N: every link measured, reports with N - 1 links) is ready when
node 0's view is measured for every pair.

    .venv/bin/python bench/gossip_scale.py                                  # 256 and 1,000; baseline 64
    .venv/bin/python bench/gossip_scale.py --sizes 256 --baseline-sizes 64,256

Every message is packed (its bytes are exact); `--decode` runs the decoders too.
Prints one line per run and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dtfm.gossip.config import GossipConfig
from dtfm.gossip.scale_sim import MeasureSimulator
from dtfm.scenarios import load_scenario

PROFILES = {"wan": GossipConfig.wan, "lan": GossipConfig.lan}


def run(n: int, config: GossipConfig, *, all_pairs: bool, seed: int, step_s: float, limit_s: float,
        settle_s: float, window_s: float, decode: bool = False) -> dict:
    t0 = time.process_time()
    if all_pairs:
        config = config.with_(full_mesh_max_peers=n, max_report_links=max(n, config.max_report_links))
    sim = MeasureSimulator(load_scenario("worldwide").scaled(n), config, seed=seed, codec=decode)
    out: dict = {"n": n, "all_pairs": all_pairs, "view_ready_s": None}
    t = 0.0
    while t < limit_s:
        t += step_s
        sim.run_until(t)
        view = sim.view(0, estimate=not all_pairs)
        if len(view.peers) == n and view.complete:
            out["view_ready_s"] = t
            out["probe_mb_per_peer_to_ready"] = round(sum(sim.measure_bytes) / n / 1e6, 2)
            out["measured_fraction_at_ready"] = round(float(view.measured().sum()) / (n * (n - 1)), 4)
            out["delay_error_at_ready"] = round(sim.delay_error(view), 4)
            break
    if out["view_ready_s"] is None:
        out["limit_s"] = limit_s
    sim.run_until(t + settle_s)
    before = {k: sum(v) for k, v in sim.bytes_by_kind().items()}
    signed = sim.reports_signed
    sim.run_until(t + settle_s + window_s)
    after = {k: sum(v) for k, v in sim.bytes_by_kind().items()}
    per = {k: (after[k] - before[k]) / window_s / n / 1000.0 for k in after}
    out["gossip_kb_per_s_per_peer"] = round(per["swim"] + per["records"], 3)
    out["swim_kb_per_s_per_peer"] = round(per["swim"], 3)
    out["records_kb_per_s_per_peer"] = round(per["records"], 3)
    out["measure_kb_per_s_per_peer"] = round(per["measure"], 3)
    out["reports_signed_per_s"] = round((sim.reports_signed - signed) / window_s, 3)
    end_view = sim.view(0, estimate=not all_pairs)
    out["delay_error_at_end"] = round(sim.delay_error(end_view), 4) if end_view.complete else None
    out["report_bytes_max"] = max((len(r.signing_bytes()) + 64 for r in sim.peers[0].store.reports.values()),
                                  default=0)
    out["cpu_s"] = round(time.process_time() - t0, 1)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256,1000", help="swarm sizes, sampled measurement")
    ap.add_argument("--baseline-sizes", default="64", help="swarm sizes, all-pairs measurement")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="wan",
                    help="gossip timings (dtfm-swarm picks wan for the worldwide scenario)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--step-s", type=float, default=2.0, help="how often the coordinator's view is checked")
    ap.add_argument("--limit-s", type=float, default=900.0, help="virtual seconds to wait for a ready view")
    ap.add_argument("--settle-s", type=float, default=60.0, help="virtual seconds between ready and the window")
    ap.add_argument("--window-s", type=float, default=60.0, help="virtual seconds of steady traffic measured")
    ap.add_argument("--decode", action="store_true",
                    help="every message through its decoder too (the bytes are the same; several times slower)")
    args = ap.parse_args(argv)
    config = PROFILES[args.profile]()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    baseline = [int(x) for x in args.baseline_sizes.split(",") if x]
    result: dict = {"scenario": "worldwide", "profile": args.profile, "sizes": {}, "baseline_all_pairs": {}}
    for n, all_pairs in [(n, True) for n in baseline] + [(n, False) for n in sizes]:
        out = run(n, config, all_pairs=all_pairs, seed=args.seed, step_s=args.step_s, limit_s=args.limit_s,
                  settle_s=args.settle_s, window_s=args.window_s, decode=args.decode)
        print(json.dumps(out), file=sys.stderr, flush=True)
        result["baseline_all_pairs" if all_pairs else "sizes"][str(n)] = out
    print(json.dumps(result))


if __name__ == "__main__":
    main()
