"""Compressed training vs exact, in one process (issue 19, parts 1 and 2).

Every method trains the same model from the same seed on the same data for the same steps
through `LocalCluster` (S stages x D pipelines on the in-memory Comm), whose Comm counts the
payload bytes each peer sends per axis: pipeline forward (activations), pipeline backward
(activation gradients), data-parallel, other (loss, norm). Reported per method: the mean
loss of the last `--last` steps and its gap to exact's, the bytes per step per axis and the
ratios exact / method, and the wall time. Loss curves go to `<out>/loss.png` (with
matplotlib), every figure to `<out>/results.json`.

    nice .venv/bin/python bench/compress.py [--steps 600] [--stages 2] [--dp 4] [--methods exact,pp-int4,...]

The last line is one JSON object: the recommended configuration's pp_bytes_ratio,
dp_bytes_ratio, total_bytes_ratio and loss_gap, and a `methods` list with the same keys per
method. speedup_measured, prediction_error and bandwidth_scale (parts 3 and 4: wall clock of
8 daemons on the emulated worldwide swarm) need the swarm to carry compressed payloads and are
null here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dtfm.train import LocalCluster, Plan, TrainConfig, get_preset, load_corpus
from dtfm.train.compress import AXES, COMPRESSION_PRESETS, DEFAULT_SLOW_LINK, get_compression

PP_GOAL, DP_GOAL, LOSS_GOAL = 7.0, 100.0, 0.02
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    ap.add_argument("--out", default="runs/bench-compress", help="folder for loss.png and results.json")
    args = ap.parse_args(argv)
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
    torch.set_num_threads(1)
    spec = get_preset(args.preset)
    cfg = TrainConfig(global_batch_seqs=args.batch, micro_batches=args.micro_batches, lr=args.lr)
    plan = Plan.grid(spec.n_layer, args.stages, args.dp)
    corpus = load_corpus()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{spec.name} {args.stages} stages x {args.dp} pipelines, batch {args.batch}, M {args.micro_batches}, "
          f"{args.steps} steps, corpus {corpus.name}", file=sys.stderr)
    runs = []
    for name in names:
        r = run_method(name, configs[name], spec, cfg, plan, corpus, args.steps)
        runs.append(r)
        print(f"  {name:<10} mean loss of the last {args.last}: {statistics.fmean(r['losses'][-args.last:]):.4f} "
              f"({r['wall_s']:.0f} s)", file=sys.stderr)
    summary = summarise(runs, args.last)
    print(f"\n| method | config | loss (last {args.last}) | gap | PP fwd B/step | PP bwd B/step | DP B/step "
          "| PP ratio | DP ratio | total ratio | wall s |", file=sys.stderr)
    print("|---|---|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for s in summary:
        b = s["bytes_per_step"]
        print(f"| {s['name']} | {s['config']} | {s['mean_loss_last']:.4f} | {100 * s['loss_gap']:+.2f} % "
              f"| {b['pp_fwd']:,} | {b['pp_bwd']:,} | {b['dp']:,} | {s['pp_bytes_ratio']} | {s['dp_bytes_ratio']} "
              f"| {s['total_bytes_ratio']} | {s['wall_s']} |", file=sys.stderr)
    note = plot(runs, out / "loss.png")
    print(note, file=sys.stderr)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "summary": summary,
                                                  "losses": {r["name"]: r["losses"] for r in runs}}, indent=1))
    rec = next(s for s in summary if s["name"] == args.recommended)
    top = {k: rec[k] for k in ("pp_bytes_ratio", "dp_bytes_ratio", "total_bytes_ratio", "loss_gap",
                                "speedup_measured", "prediction_error", "bandwidth_scale")}
    goals = {"pp_ratio_goal": PP_GOAL, "dp_ratio_goal": DP_GOAL, "loss_gap_goal": LOSS_GOAL}
    print(json.dumps({"recommended": args.recommended, **top, **goals,
                      "note": "speedup_measured, prediction_error and bandwidth_scale need the swarm parts "
                              "(issue 19 parts 3 and 4); not measured here",
                      "methods": [{k: v for k, v in s.items() if k != "config"} | {"config": s["config"]}
                                  for s in summary]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
