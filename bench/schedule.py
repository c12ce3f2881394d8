"""The pipeline schedule the coordinator fits to the links (1F1B with warm-ups) against GPipe,
on swarms of daemons under emulated world-wide links.

    .venv/bin/python bench/schedule.py [--rounds 2] [--steps 40] [--bandwidth-scale 0.01099]
        [--methods exact,slow-link]

Each round starts two fresh 8-peer worldwide swarms in turn, one whose coordinator hands out
the fitted schedule (`dtfm-swarm up --pipeline-schedule fitted`, the default) and one that
hands out GPipe (`--pipeline-schedule gpipe`: the baseline, measured in the same run), and
trains each method for `--steps` steps on each (`train --stages 4`, exact then `--compress
slow-link`, the scheduler choosing the pipelines and the micro-batch count, as
bench/compress_swarm.py runs them; at its bandwidth scale exact `tiny` is as bandwidth-bound as
GPT-3 XL on the paper's network). For every run: the schedule handed out, the median step
(the first two left out), its prediction, the time to the last step, and the last step's loss
(a schedule never changes the result: the losses must be the same bits). Prints one JSON object
as its last line: per method, the mean and spread over the rounds of each schedule's median
step and the speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from common import WAN_PLANE, read_rows, running_swarm, swarm

SCHEDULES = ("fitted", "gpipe")
METHODS = {"exact": (), "slow-link": ("--compress", "slow-link")}
COMPRESS_SCALE = 0.01099  # bench/compress_swarm.py's computed scale (exact `tiny` 79 % bandwidth-bound)


def run_method(run_dir: Path, method: str, steps: int) -> dict:
    """One run of `method` on the swarm: its allocation's schedule, median step, prediction,
    time to its last step and last loss."""
    reply = json.loads(swarm(run_dir, "train", "--json", "--stages", "4", "--steps", str(steps),
                             *METHODS[method], stdout=True))
    swarm(run_dir, "wait", "--step", str(steps), "--timeout", "900", timeout_s=1000)
    rows = sorted((r for r in read_rows(run_dir) if not r.get("backfilled")), key=lambda r: r["step"])
    times = [r["iteration_s"] for r in rows if r.get("iteration_s")]
    return {"warmups": reply.get("train", {}).get("pipeline_warmups", "") or "gpipe",
            "micro_batches": reply.get("train", {}).get("micro_batches"),
            "pipelines": reply.get("pipelines"), "steps": len(rows),
            "median_s": round(statistics.median(times[2:] or times), 4),
            "predicted_s": round(rows[0]["predicted_iteration_s"], 4),
            "total_s": round(sum(times), 2), "last_loss": rows[-1].get("loss")}


def spread(values: list[float]) -> dict:
    return {"mean": round(statistics.mean(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of one swarm per schedule (default: 2)")
    parser.add_argument("--steps", type=int, default=40, help="steps of each run (default: 40)")
    parser.add_argument("--bandwidth-scale", type=float, default=COMPRESS_SCALE,
                        help=f"the emulated links' bandwidth scale (default: {COMPRESS_SCALE})")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated: " + ", ".join(METHODS))
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if not methods or set(methods) - set(METHODS) or args.rounds < 1 or args.steps < 4:
        parser.error(f"--methods from {', '.join(METHODS)}, --rounds at least 1, --steps at least 4")
    runs: list[dict] = []
    for k in range(args.rounds):
        for schedule in SCHEDULES:
            up = ("--scenario", "worldwide", "--peers", "8", "--bandwidth-scale", str(args.bandwidth_scale),
                  "--timeout", "600", *WAN_PLANE, "--pipeline-schedule", schedule)
            with running_swarm(*up, kill=True, prefix="dtfm-bench-schedule-") as run_dir:
                for method in methods:
                    r = {"round": k + 1, "schedule": schedule, "method": method, **run_method(run_dir, method, args.steps)}
                    runs.append(r)
                    print(f"round {r['round']} {schedule:6s} {method:9s}: warm-ups {r['warmups']}, "
                          f"{r['micro_batches']} micro-batches, median {r['median_s']:.3f} s/step "
                          f"(predicted {r['predicted_s']:.3f}), {r['steps']} steps in {r['total_s']:.1f} s, "
                          f"last loss {r['last_loss']}", flush=True)
    summary: dict = {}
    for method in methods:
        med = {s: [r["median_s"] for r in runs if r["method"] == method and r["schedule"] == s] for s in SCHEDULES}
        pairs = [(g, f) for g, f in zip(med["gpipe"], med["fitted"])]
        losses = {(r["round"], r["schedule"]): r["last_loss"] for r in runs if r["method"] == method}
        summary[method] = {"fitted_median_s": spread(med["fitted"]), "gpipe_median_s": spread(med["gpipe"]),
                           "speedup": spread([g / f for g, f in pairs]),
                           "same_losses": all(losses[(k + 1, "fitted")] == losses[(k + 1, "gpipe")]
                                              for k in range(args.rounds))}
    print(json.dumps({"bandwidth_scale": args.bandwidth_scale, "steps": args.steps, "runs": runs,
                      "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
