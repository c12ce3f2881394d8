"""Compressed training vs exact (issue 19, parts 1 to 3).

Parts 1 and 2, in one process: every method trains the same model from the same seed on the
same data for the same steps through `LocalCluster` (S stages x D pipelines on the in-memory
Comm), whose Comm counts the payload bytes each peer sends per axis: pipeline forward
(activations), pipeline backward (activation gradients), data-parallel, other (loss, norm).
Reported per method: the mean loss of the last `--last` steps and its gap to exact's, the bytes
per step per axis and the ratios exact / method, and the wall time. Loss curves go to
`<out>/loss.png` (with matplotlib), every figure to `<out>/results.json`.

Part 3, through the daemons: `bench/compress_swarm.py` (run as its own process) starts 8
daemons on the emulated worldwide scenario at `--bandwidth-scale`, trains exact `tiny` and
each of `--swarm-methods` on that swarm, and measures the iteration time of each and the
simulator's error on the compressed run; its figures go to `<out>/swarm.json`.

    nice .venv/bin/python bench/compress.py [--parts 1,2,3] [--steps 600] [--stages 2] [--dp 4] [--methods exact,pp-int4,...]

The last line is one JSON object: the recommended configuration's pp_bytes_ratio,
dp_bytes_ratio, total_bytes_ratio and loss_gap (parts 1 and 2), speedup_measured,
prediction_error and bandwidth_scale (part 3), and a `methods` list with the same keys per
method; keys of a part that did not run are null. Part 4 (the scheduler's choice) is
bench/compress_sched.py's, simulated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from dtfm.train import LocalCluster, Plan, TrainConfig, get_preset, load_corpus
from dtfm.train.compress import AXES, COMPRESSION_PRESETS, DEFAULT_SLOW_LINK, get_compression

from common import print_table, write_json

PP_GOAL, DP_GOAL, LOSS_GOAL = 7.0, 100.0, 0.02
SPEEDUP_GOAL, PREDICTION_GOAL = 4.0, 0.25
HERE = Path(__file__).resolve().parent
PARTS = ("1", "2", "3")
DEFAULT_METHODS = ("exact", "pp-int8", "pp-int4", "cocktail", "diloco", DEFAULT_SLOW_LINK)


def run_method(name: str, comp, spec, cfg: TrainConfig, plan: Plan, corpus, steps: int) -> dict:
    losses, per_axis = [], dict.fromkeys(AXES, 0)
    t0 = time.perf_counter()
    with LocalCluster(spec, cfg, plan, corpus, compression=comp) as cl:
        for _ in range(steps):
            losses.append(cl.step())
        for a, b in cl.bytes_sent.items():
            per_axis[a] = b
    wall = time.perf_counter() - t0
    return {"name": name, "config": comp.describe(), "losses": losses, "wall_s": wall,
            "bytes_per_step": {a: b / steps for a, b in per_axis.items()}}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def summarise(runs: list[dict], last: int) -> list[dict]:
    exact = next(r for r in runs if r["name"] == "exact")
    ex_b = exact["bytes_per_step"]
    ex_loss = statistics.fmean(exact["losses"][-last:])
    out = []
    for r in runs:
        b = r["bytes_per_step"]
        mean = statistics.fmean(r["losses"][-last:])
        pp, ex_pp = b["pp_fwd"] + b["pp_bwd"], ex_b["pp_fwd"] + ex_b["pp_bwd"]
        out.append({
            "name": r["name"], "config": r["config"],
            "mean_loss_last": round(mean, 5), "loss_gap": round(mean / ex_loss - 1, 5),
            "bytes_per_step": {a: round(v) for a, v in b.items()},
            "pp_fwd_ratio": _round(_ratio(ex_b["pp_fwd"], b["pp_fwd"])),
            "pp_bwd_ratio": _round(_ratio(ex_b["pp_bwd"], b["pp_bwd"])),
            "pp_bytes_ratio": _round(_ratio(ex_pp, pp)),
            "dp_bytes_ratio": _round(_ratio(ex_b["dp"], b["dp"])),
            "total_bytes_ratio": _round(_ratio(sum(ex_b.values()), sum(b.values()))),
            "wall_s": round(r["wall_s"], 1),
            "speedup_measured": None, "prediction_error": None, "bandwidth_scale": None,
        })
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def plot(runs: list[dict], path: Path) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in runs:
        xs = range(len(r["losses"]))
        k = 10  # running mean over 10 steps, the raw curves are noisy
        ys = [statistics.fmean(r["losses"][max(0, i - k + 1):i + 1]) for i in xs]
        ax.plot(xs, ys, label=r["name"], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (running mean of 10 steps)")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"loss curves: {path}"


def part3(args, out: Path) -> dict:
    """bench/compress_swarm.py as its own process; its JSON line."""
    cmd = [sys.executable, str(HERE / "compress_swarm.py"), "--bandwidth-scale", str(args.bandwidth_scale),
           "--methods", args.swarm_methods, "--recommended", args.recommended if args.recommended in
           args.swarm_methods.split(",") else args.swarm_methods.split(",")[0],
           "--exact-steps", str(args.swarm_exact_steps), "--steps", str(args.swarm_steps),
           "--skip", str(args.swarm_skip), "--out", str(out / "swarm.json")]
    print("part 3: " + " ".join(cmd[1:]), file=sys.stderr)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=3600)  # stderr: the table, as it goes
    if proc.returncode != 0:
        raise RuntimeError(f"bench/compress_swarm.py failed ({proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def part12(args, names: list[str], configs: dict, out: Path) -> list[dict]:
    spec = get_preset(args.preset)
    cfg = TrainConfig(global_batch_seqs=args.batch, micro_batches=args.micro_batches, lr=args.lr)
    plan = Plan.grid(spec.n_layer, args.stages, args.dp)
    corpus = load_corpus()
    print(f"{spec.name} {args.stages} stages x {args.dp} pipelines, batch {args.batch}, M {args.micro_batches}, "
          f"{args.steps} steps, corpus {corpus.name}", file=sys.stderr)
    runs = []
    for name in names:
        r = run_method(name, configs[name], spec, cfg, plan, corpus, args.steps)
        runs.append(r)
        print(f"  {name:<10} mean loss of the last {args.last}: {statistics.fmean(r['losses'][-args.last:]):.4f} "
              f"({r['wall_s']:.0f} s)", file=sys.stderr)
    summary = summarise(runs, args.last)
    print_table(["method", "config", f"loss (last {args.last})", "gap", "PP fwd B/step", "PP bwd B/step", "DP B/step",
                 "PP ratio", "DP ratio", "total ratio", "wall s"],
                ([s["name"], s["config"], f"{s['mean_loss_last']:.4f}", f"{100 * s['loss_gap']:+.2f} %",
                  f"{s['bytes_per_step']['pp_fwd']:,}", f"{s['bytes_per_step']['pp_bwd']:,}",
                  f"{s['bytes_per_step']['dp']:,}", s["pp_bytes_ratio"], s["dp_bytes_ratio"], s["total_bytes_ratio"],
                  s["wall_s"]] for s in summary))
    print(plot(runs, out / "loss.png"), file=sys.stderr)
    write_json(out / "results.json", {"args": vars(args), "summary": summary,
                                      "losses": {r["name"]: r["losses"] for r in runs}})
    return summary


def merge_swarm(summary: list[dict], swarm: dict | None, names: list[str], configs: dict) -> list[dict]:
    """Part 1-2 rows (or bare rows when those parts did not run) with part 3's figures per method."""
    rows = {s["name"]: dict(s) for s in summary}
    for n in names:
        rows.setdefault(n, {"name": n, "config": configs[n].describe(), **dict.fromkeys(
            ("pp_bytes_ratio", "dp_bytes_ratio", "total_bytes_ratio", "loss_gap",
             "speedup_measured", "prediction_error", "bandwidth_scale"))})
    if swarm is not None:
        for m in swarm["methods"]:
            row = rows.setdefault(m["name"], {"name": m["name"], **dict.fromkeys(
                ("config", "pp_bytes_ratio", "dp_bytes_ratio", "total_bytes_ratio", "loss_gap"))})
            row.update({"speedup_measured": m["speedup_measured"], "prediction_error": m["prediction_error"],
                        "bandwidth_scale": swarm["bandwidth_scale"], "swarm_measured_s": m["measured_s"],
                        "swarm_predicted_s": m["predicted_s"]})
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", "--only", default=",".join(PARTS),
                    help="comma-separated parts: 1 and 2 (in one process; they are the same runs), 3 (8 daemons)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--last", type=int, default=50, help="steps the final mean loss is taken over")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="global batch in sequences")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma-separated presets from {sorted(COMPRESSION_PRESETS)}; exact is always run")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=PRESET[:FIELD=VALUE,...]",
                    help="an extra method: a preset with CompressionConfig fields overridden; repeatable")
    ap.add_argument("--recommended", default=DEFAULT_SLOW_LINK, help="the method the JSON line's top level reports")
    ap.add_argument("--bandwidth-scale", type=float, default=0.0285,
                    help="part 3: emulated bandwidth x this (bench/compress_sched.py's scale for a 93.5 %% "
                         "communication share)")
    ap.add_argument("--swarm-methods", default=DEFAULT_SLOW_LINK,
                    help="part 3: compressed presets run on the daemons, comma-separated")
    ap.add_argument("--swarm-exact-steps", type=int, default=14, help="part 3: steps of the exact run")
    ap.add_argument("--swarm-steps", type=int, default=50, help="part 3: steps of each compressed run")
    ap.add_argument("--swarm-skip", type=int, default=2, help="part 3: first steps left out")
    ap.add_argument("--out", default="runs/bench-compress", help="folder for loss.png, results.json, swarm.json")
    args = ap.parse_args(argv)
    parts = {p for p in args.parts.split(",") if p}
    if not parts or not parts <= set(PARTS):
        ap.error(f"--parts takes a comma-separated subset of {','.join(PARTS)}")
    names = [m for m in args.methods.split(",") if m]
    configs = {m: get_compression(m) for m in names}
    for v in args.variant:
        name, _, rest = v.partition("=")
        preset, _, opts = rest.partition(":")
        try:
            configs[name] = get_compression(preset).with_options([o for o in opts.split(",") if o])
        except ValueError as e:
            ap.error(f"--variant {v}: {e}")
        names.append(name)
    if "exact" not in names:
        names.insert(0, "exact")
        configs["exact"] = get_compression("exact")
    if args.recommended not in names:
        ap.error(f"--recommended {args.recommended} is not among --methods")
    for m in args.swarm_methods.split(","):
        try:
            get_compression(m)
        except ValueError as e:
            ap.error(f"--swarm-methods: {e}")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = part12(args, names, configs, out) if parts & {"1", "2"} else []
    swarm = part3(args, out) if "3" in parts else None
    rows = merge_swarm(summary, swarm, names if summary else [args.recommended], configs)
    rec = next(s for s in rows if s["name"] == args.recommended)
    top = {k: rec.get(k) for k in ("pp_bytes_ratio", "dp_bytes_ratio", "total_bytes_ratio", "loss_gap",
                                    "speedup_measured", "prediction_error", "bandwidth_scale")}
    goals = {"pp_ratio_goal": PP_GOAL, "dp_ratio_goal": DP_GOAL, "loss_gap_goal": LOSS_GOAL,
             "speedup_goal": SPEEDUP_GOAL, "prediction_error_goal": PREDICTION_GOAL}
    missing = [f"parts {p}" for p, ran in (("1-2", bool(summary)), ("3", swarm is not None)) if not ran]
    extra = {"note": f"not run: {', '.join(missing)} (their keys are null)"} if missing else {}
    if swarm is not None:
        extra["swarm_shape"] = swarm["shape"]
    print(json.dumps({"recommended": args.recommended, "parts": sorted(parts), **top, **goals, **extra,
                      "methods": [{k: v for k, v in s.items() if k != "config"} | {"config": s.get("config")}
                                  for s in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
