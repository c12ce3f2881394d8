"""The scheduler's predicted step against the measured one, on swarms of daemons on this machine.

    .venv/bin/python bench/predictions.py [--settings loopback,demo,demo-4x2] [--runs 3] [--steps 80]
        [--spinners N]

Each setting runs `--runs` times, one swarm at a time:

- loopback: 3 daemons on plain loopback (`dtfm-swarm up --peers 3 --no-emulation --scenario
  datacenter`, `train --steps N`): the scheduler's shape;
- demo: `dtfm-swarm demo --steps N` (8 daemons, emulated worldwide): the scheduler's shape;
- demo-4x2: the same with `--stages 4 --dp 2` (every peer placed);
- demo-slow-link: the demo with `--stages 4 --compress slow-link --bandwidth-scale S` (S:
  `--bandwidth-scale`, the scale at which exact `tiny` is as bandwidth-bound as GPT-3 XL on the
  paper's network, as bench/compress_swarm.py computes it);
- after-exact: 8 daemons at that scale (`up --plane-profile wan`), exact `--stages 4` for 64
  steps, then `--compress slow-link --stages 4` for N steps on the same swarm: the second run
  is measured, placed on the figures the peers reported from the first (a run placed after
  another on one machine).

`--spinners N` runs N processes that spin on a core beside each swarm, started before it and
stopped after (a machine loaded by other work).

For each run: the first epoch's measured median step (steps after the first two, from the run
dir's step log) against the first prediction (`train start`'s, the step log's first
`predicted_iteration_s`), and the last epoch's against its last prediction (the drift check's
re-estimate on the peers' own steps, or a reconfiguration's, where there was one), each as an
error in %, with the load average at the start and end. The baseline is the run's own measured median:
the figures are the predictions' errors, whatever the machine's speed. Prints one JSON object as
its last line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

SWARM = [sys.executable, "-m", "dtfm.swarm"]
SETTINGS = ("loopback", "demo", "demo-4x2", "demo-slow-link", "after-exact")
COMPRESS_SCALE = 0.01099  # bench/compress_swarm.py's computed scale for `tiny` on the worldwide network
EXACT_STEPS = 64  # after-exact: the first (exact) run's steps


def _load() -> float:
    return os.getloadavg()[0]


def _run(args: list[str], timeout_s: float) -> None:
    subprocess.run(args, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(setting: str, run_dir: Path, steps: int, scale: float = COMPRESS_SCALE) -> dict:
    """Run one swarm of `setting`; its predictions against its measured median step (of its
    last run, where it trains twice)."""
    load0 = _load()
    if setting in ("loopback", "after-exact"):
        up = (["--peers", "3", "--no-emulation", "--scenario", "datacenter"] if setting == "loopback" else
              ["--peers", "8", "--scenario", "worldwide", "--bandwidth-scale", str(scale), "--plane-profile", "wan"])
        runs = ([([], steps)] if setting == "loopback" else  # (train's arguments, its steps)
                [(["--stages", "4"], EXACT_STEPS), (["--stages", "4", "--compress", "slow-link"], steps)])
        try:
            _run([*SWARM, "up", "--run-dir", str(run_dir), "--fresh", *up, "--timeout", "400"], 600)
            for train, n in runs:
                _run([*SWARM, "train", "--run-dir", str(run_dir), *train, "--steps", str(n)], 300)
                _run([*SWARM, "wait", "--run-dir", str(run_dir), "--step", str(n), "--timeout", "900"], 1000)
        finally:
            subprocess.run([*SWARM, "down", "--run-dir", str(run_dir)], timeout=300, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    else:
        extra = {"demo-4x2": ["--stages", "4", "--dp", "2"],
                 "demo-slow-link": ["--stages", "4", "--compress", "slow-link", "--bandwidth-scale", str(scale)]}
        _run([*SWARM, "demo", "--run-dir", str(run_dir), "--steps", str(steps), *extra.get(setting, [])], 1200)
    rows = sorted((json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines() if line.strip()),
                  key=lambda r: r.get("step", 0))
    rows = [r for r in rows if r.get("iteration_s")]
    last_run = max(rows, key=lambda r: r.get("time", 0.0)).get("run") if rows else None  # (the newest run)
    rows = [r for r in rows if r.get("run") == last_run]
    # each epoch against its own predictions: a reconfiguration (a drift check's, or a new
    # coordinator's after an election on a loaded machine) changes the shape
    epochs = [[r for r in rows if r["epoch"] == e] for e in sorted({r["epoch"] for r in rows})]
    first_epoch, last_epoch = epochs[0], epochs[-1]
    measured = _median_step(first_epoch)
    first = first_epoch[0]["predicted_iteration_s"]
    out = {"setting": setting, "steps": len(rows), "epochs": len(epochs), "measured_s": round(measured, 4),
           "first_predicted_s": round(first, 4), "first_error_pct": round(100 * (first - measured) / measured, 1),
           "load_start": round(load0, 1), "load_end": round(_load(), 1)}
    last = last_epoch[-1]["predicted_iteration_s"]
    if len(last_epoch) >= 5 and (len(epochs) > 1 or abs(last - first) > 1e-9):
        m = _median_step(last_epoch)
        out.update(last_measured_s=round(m, 4), last_predicted_s=round(last, 4),
                   last_error_pct=round(100 * (last - m) / m, 1))
    return out


@contextlib.contextmanager
def spinning(n: int) -> Iterator[None]:
    """n processes that each keep a core busy, for the block's duration."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _median_step(rows: list[dict]) -> float:
    """The median step of an epoch, its first two left out where it has more."""
    return statistics.median(r["iteration_s"] for r in (rows[2:] if len(rows) > 2 else rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated: " + ", ".join(SETTINGS))
    parser.add_argument("--runs", type=int, default=3, help="runs of each setting")
    parser.add_argument("--steps", type=int, default=80, help="steps of each run (demo-4x2: at most 30)")
    parser.add_argument("--run-dir", type=Path, default=None, help="where the swarms' run dirs go (default: a temp dir)")
    parser.add_argument("--spinners", type=int, default=0,
                        help="processes spinning on a core beside each swarm (a loaded machine; default: 0)")
    parser.add_argument("--bandwidth-scale", type=float, default=COMPRESS_SCALE,
                        help=f"demo-slow-link and after-exact: the emulated bandwidth's scale (default: {COMPRESS_SCALE})")
    args = parser.parse_args(argv)
    if args.spinners < 0:
        parser.error("--spinners must be at least 0")
    settings = [s for s in args.settings.split(",") if s]
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        parser.error(f"unknown settings: {', '.join(unknown)}")
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="dtfm-predictions-"))
    results = []
    for k in range(args.runs):
        for setting in settings:
            steps = min(args.steps, 30) if setting == "demo-4x2" else args.steps
            with spinning(args.spinners):
                r = measure(setting, root / f"{setting}-{k + 1}", steps, args.bandwidth_scale)
            r["spinners"] = args.spinners
            results.append(r)
            last = (f"last epoch's last prediction {r['last_predicted_s']:.3f} against {r['last_measured_s']:.3f} "
                    f"({r['last_error_pct']:+.0f} %)" if "last_error_pct" in r else "no re-estimate")
            print(f"{setting} run {k + 1}: first epoch measured {r['measured_s']:.3f} s/step, first prediction "
                  f"{r['first_predicted_s']:.3f} ({r['first_error_pct']:+.0f} %); {r['epochs']} epoch(s), {last}; "
                  f"load {r['load_start']}-{r['load_end']}", flush=True)
    summary = {}
    for setting in settings:
        mine = [r for r in results if r["setting"] == setting]
        summary[setting] = {"first_error_pct": [r["first_error_pct"] for r in mine],
                            "last_error_pct": [r["last_error_pct"] for r in mine if "last_error_pct" in r],
                            "within_25pct_first": sum(abs(r["first_error_pct"]) <= 25 for r in mine),
                            "runs": len(mine)}
    print(json.dumps({"runs": results, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
