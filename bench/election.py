"""Coordinator election on the simulated network (control/testing/election_sim.py), in virtual time.

Take-over: 1,000 coordinator crashes in swarms of 5 to 9 peers spread over the worldwide
scenario's cities (one-way delays of its matrix, 5 to 238 ms, times a jitter of up to 30 %).
Each crash comes at a random phase of the heartbeat; the time is from the crash to the next
coordinator's election, in units of the minimum election timeout.

Returning peer: a follower is cut off for 20 s (or is down as long and restarts with its
stored term raised by 5), then returns. Counted over the trials: coordinators deposed (stepped
down and waited for an election), coordinators changed (another peer won a term), and
coordinators that stood again at once in a higher term; with pre-vote and leases, and with
plain Raft (no pre-vote, no check-quorum) as the baseline.

    .venv/bin/python bench/election.py                 # 1,000 crashes, 100 trials per case
    .venv/bin/python bench/election.py --crashes 200 --trials 20

Prints one line per part and, last, one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

from dtfm.control.election import ElectionConfig
from dtfm.control.testing.election_sim import returning_peer, takeover_times

SIZES = (5, 6, 7, 8, 9)
CRASHES_PER_SWARM = 10
AWAY_S = 20.0
INFLATE_TERMS = 5
MEDIAN_BOUND, WORST_BOUND = 2.0, 3.5  # in minimum election timeouts


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def takeover(cfg: ElectionConfig, crashes: int, seed: int) -> dict:
    times, violations, swarms = [], 0, 0
    while len(times) < crashes:
        n = SIZES[swarms % len(SIZES)]
        t, sim = takeover_times(cfg, n, min(CRASHES_PER_SWARM, crashes - len(times)), seed=seed + swarms)
        times += t
        violations += len(sim.violations)
        swarms += 1
    x = [t / cfg.election_timeout_min_s for t in times]
    return {"crashes": len(x), "swarms": swarms, "violations": violations,
            "median_x": round(statistics.median(x), 3), "p99_x": round(percentile(x, 0.99), 3),
            "worst_x": round(max(x), 3), "median_s": round(statistics.median(times), 3),
            "worst_s": round(max(times), 3),
            "within_bounds": statistics.median(x) <= MEDIAN_BOUND and max(x) <= WORST_BOUND}


def returning(cfg: ElectionConfig, trials: int, seed: int, inflate: int) -> dict:
    rs = [returning_peer(cfg, SIZES[i % len(SIZES)], seed=seed + i, away_s=AWAY_S, inflate_terms=inflate)
          for i in range(trials)]
    return {"trials": trials, "deposed": sum(r["deposed"] for r in rs), "changed": sum(r["changed"] for r in rs),
            "stood_again": sum(r["stood_again"] for r in rs),
            "returned_term_ahead_mean": round(statistics.mean(r["returned_term_ahead"] for r in rs), 2),
            "violations": sum(len(r["violations"]) for r in rs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--crashes", type=int, default=1000)
    ap.add_argument("--trials", type=int, default=100, help="returning-peer trials per case")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = ElectionConfig.wan()
    plain = cfg.with_(pre_vote=False, check_quorum=False)
    t0 = time.perf_counter()
    out: dict = {"config": dataclasses.asdict(cfg), "sizes": list(SIZES), "scenario": "worldwide", "jitter": 0.3}
    out["takeover"] = takeover(cfg, args.crashes, args.seed)
    print(f"take-over: {out['takeover']}", flush=True)
    cases = {"pre_vote_cut_off": (cfg, 0), "plain_raft_cut_off": (plain, 0),
             "pre_vote_inflated_store": (cfg, INFLATE_TERMS), "plain_raft_inflated_store": (plain, INFLATE_TERMS)}
    out["returning_peer"] = {"away_s": AWAY_S}
    for name, (c, inflate) in cases.items():
        out["returning_peer"][name] = returning(c, args.trials, args.seed, inflate)
        print(f"returning peer, {name}: {out['returning_peer'][name]}", flush=True)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 0 if out["takeover"]["within_bounds"] and out["takeover"]["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
