"""Compressed vs exact training through the real daemons, measured (issue 19, part 3).

Eight `dtfm-peer` daemons on the emulated worldwide scenario (`dtfm-swarm up --scenario
worldwide --peers 8 --bandwidth-scale S`, the control plane's wan timings). On that one swarm:
exact `tiny` in the shape the swarm's scheduler picks, then each compressed configuration in the
same shape (`dtfm-swarm train --stages S --dp D --compress NAME`), N steps each.

Measured: each run's iteration time from `train.jsonl` (`iteration_s`, the slowest peer's step),
the first `--skip` steps left out (connections warming up). A run whose DP groups synchronise
every H steps (DiLoCo) has two kinds of step; its iteration time is the cycle's mean of the
two medians, ((H - 1) x median of the local steps + median of the synchronising steps) / H, so
the synchronisations are paid for and one slow step does not move the figure
(`cycle_iteration_s`); with H = 1 it is the plain median. speedup_measured = exact / compressed.

Predicted: `dtfm.sched`'s GPipe simulator with the trainer's round trips (`engine_syncs`, as the
coordinator predicts) on the network view the daemons measured (read from a daemon's status),
for the run's own allocation, every link and DP group coding with the run's codec
(`CodecAssignment.uniform`; a per-link run, e.g. `auto`, with the coordinator's choice of links
and groups from the start's reply, `compress_links`), coding at the speed `measure_compress_cost()` measures on this
CPU (one thread), and compute per layer from the exact run's measured compute (the slowest
peer's `compute_s` per step / (M x layers per stage)). prediction_error = |predicted -
measured| / measured. Also printed: the same prediction for the exact run (the model's error
on the baseline), without compute (what the coordinator's `predicted_iteration_s` counts), and
at unlimited bandwidth (latency, compute and coding alone: the floor compression cannot go
under).

    nice .venv/bin/python bench/compress_swarm.py [--bandwidth-scale 0.0285] [--methods slow-link,pp-int4]
        [--exact-steps 14] [--steps 50] [--skip 2]

The bandwidth scale 0.0285 is bench/compress_sched.py's: the scale at which exact `tiny` on this
swarm communicates the same share of its iteration (93.5 %) as the paper's GPT-3 XL on its
worldwide network. Wall-clock figures share this machine's cores with whatever else runs. The
last line is one JSON object; `bench/compress.py --parts 3` runs this and merges it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from common import WAN_PLANE, print_table, read_rows, running_swarm, swarm, write_json

DEFAULT_SCALE = 0.0285  # bench/compress_sched.py, docs/compression.md
SPEEDUP_GOAL, PREDICTION_GOAL = 4.0, 0.25
SWEEP_FACTORS = (1.0, 0.5, 0.25, 0.1)  # simulated only: the measured view's bandwidths x these


# ---- pure helpers (tests/test_bench_compress_swarm.py) -------------------------------------------


def cycle_iteration_s(rows: list[dict], period: int, skip: int) -> dict:
    """Iteration time of a run from its train.jsonl lines (dicts with `step`, `iteration_s`):
    steps before `skip` are left out; with `period` H > 1 the steps that synchronise (step + 1
    a multiple of H) and the local ones are summarised apart and weighted by the cycle,
    ((H - 1) local + sync) / H, each the median of its kind. `iteration_s` None when the kept
    steps hold no step of a needed kind."""
    if period < 1:
        raise ValueError(f"period must be at least 1, got {period}")
    kept = [r for r in rows if r.get("step", -1) >= skip and isinstance(r.get("iteration_s"), (int, float))]
    sync = [r["iteration_s"] for r in kept if (r["step"] + 1) % period == 0]
    local = [r["iteration_s"] for r in kept if (r["step"] + 1) % period != 0]
    sync_med = statistics.median(sync) if sync else None
    local_med = statistics.median(local) if local else None
    if period == 1:
        it = sync_med
    elif sync_med is None or local_med is None:
        it = None
    else:
        it = ((period - 1) * local_med + sync_med) / period
    return {"iteration_s": it, "median_s": statistics.median([*sync, *local]) if kept else None,
            "sync_median_s": sync_med, "local_median_s": local_med, "sync_steps": len(sync),
            "local_steps": len(local), "period": period}


def _finite_rows(matrix, digits: int) -> list[list[float | None]]:
    """A matrix as JSON lists, None where a figure is not finite (the diagonal, an unknown link)."""
    return [[round(float(v), digits) if np.isfinite(v) else None for v in row] for row in np.asarray(matrix)]


def relative_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured."""
    if not measured > 0:
        raise ValueError(f"measured time must be positive, got {measured}")
    return abs(predicted - measured) / measured


def allocation_matrix(pipelines: list[list[str]], view_peers: list[str]) -> np.ndarray:
    """(S, D) indices into the view's peers of an allocation's pipelines ([d][s]: peer id hex)."""
    index = {p: i for i, p in enumerate(view_peers)}
    missing = [p[:8] for pipe in pipelines for p in pipe if p not in index]
    if missing:
        raise ValueError(f"peers {missing} of the allocation are not in the view")
    return np.array([[index[p] for p in pipe] for pipe in pipelines], dtype=np.int64).T


# ---- the swarm ---------------------------------------------------------------------------------


def measured_view(run_dir: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The N x N view (peer ids, delay ms, bandwidth Gbps) a live daemon of the swarm holds."""
    from dtfm.swarm.proc import peer_status
    from dtfm.swarm.state import load_state
    for p in load_state(run_dir).peers:
        st = peer_status(p) or {}
        v = (st.get("gossip") or {}).get("view") or {}
        if v.get("complete") and v.get("delay_ms") is not None:
            delay = np.array([[np.nan if x is None else x for x in row] for row in v["delay_ms"]], dtype=float)
            bw = np.array([[np.inf if x is None else x for x in row] for row in v["bandwidth_gbps"]], dtype=float)
            np.fill_diagonal(delay, 0.0)
            np.fill_diagonal(bw, np.inf)
            return list(v["peers"]), np.nan_to_num(delay, nan=0.0), bw
    raise RuntimeError("no daemon of the swarm holds a complete network view")


def train_run(run_dir: Path, steps: int, *train_args: str) -> tuple[dict, list[dict], tuple]:
    reply = json.loads(swarm(run_dir, "train", "--json", "--steps", str(steps), *train_args, stdout=True))
    view = measured_view(run_dir)  # the view the run was scheduled on (links re-measure slowly)
    from dtfm.swarm.state import load_state
    region = {p.peer_id: p.region for p in load_state(run_dir).peers}
    reply["regions"] = [[region.get(p, p[:8]) for p in pipe] for pipe in reply["pipelines"]]
    swarm(run_dir, "wait", "--step", str(steps), "--timeout", "1200", timeout_s=1300)
    rows = [r for r in read_rows(run_dir) if not r.get("backfilled")]
    return reply, rows, view


# ---- the prediction ----------------------------------------------------------------------------


def predict(view: tuple, reply: dict, config, speed, layer_compute_s: float | None, *,
            unlimited_bandwidth: bool = False, bandwidth_factor: float = 1.0, engine_syncs: bool = True) -> dict:
    """The simulator's iteration time of the run `reply` describes, coding with `config`."""
    from dtfm.control import sched_spec
    from dtfm.sched import CodecAssignment, CompressionOptions, CostModel, simulate_iteration, wire_codecs
    from dtfm.train import TrainConfig, get_preset

    peers, delay, bw = view
    X = allocation_matrix(reply["pipelines"], peers)
    S, D = X.shape
    cfg = TrainConfig()
    mspec = sched_spec(get_preset("tiny"), cfg, D)
    if layer_compute_s is not None:
        from dataclasses import replace
        at_one = replace(mspec, reference_tflops=1.0).workload(S, D).layer_compute_s
        assert at_one is not None
        mspec = replace(mspec, reference_tflops=at_one / layer_compute_s)
    pp, dp = wire_codecs(config)
    opts = CompressionOptions((pp,) if pp.exact else (type(pp)(), pp), (dp,) if dp.exact else (type(dp)(), dp), speed)
    if unlimited_bandwidth:
        bw = np.full_like(bw, 1e9)
    bw = bw * bandwidth_factor
    model = CostModel(delay, bw, mspec.workload(S, D), compression=opts)
    codecs = CodecAssignment.uniform(S, D, pp, dp)
    links = reply.get("compress_links")  # a per-link run: the coordinator's choice, from the allocation
    if links is not None:
        codecs = CodecAssignment(tuple(tuple(pp if on else type(pp)() for on in row) for row in links["pp"]),
                                 tuple(dp if on else type(dp)() for on in links["dp"]))
    sim = simulate_iteration(model, X, micro_batches=cfg.micro_batches, engine_syncs=engine_syncs, codecs=codecs)
    enc, dec = model.pp_coding_s(pp)
    return {"iteration_s": float(sim.iteration_s), "pipeline_s": float(sim.pipeline_s),
            "allreduce_s": [round(float(a), 4) for a in sim.allreduce_s],
            "pp_coding_s_per_message": round(enc + dec, 6), "sync_every": list(sim.sync_every)}


# ---- the bench ---------------------------------------------------------------------------------


def phases(rows: list[dict], skip: int) -> dict:
    kept = [r for r in rows if r["step"] >= skip]
    out = {}
    for k in ("compute_s", "pipeline_s", "sync_s"):  # the slowest peer's, per step
        vals = [r[k] for r in kept if isinstance(r.get(k), (int, float))]
        out[k] = round(statistics.median(vals), 4) if vals else None
    sent = [r["bytes_sent"] for r in kept if isinstance(r.get("bytes_sent"), dict)]
    out["bytes_per_step"] = {a: round(statistics.fmean(b.get(a, 0) for b in sent)) for a in
                             ("pp_fwd", "pp_bwd", "dp", "other")} if sent else None
    return out


def run(args) -> dict:
    import torch

    from dtfm.train.compress import measure_compress_cost, parse_compression

    torch.set_num_threads(1)
    methods = [m for m in args.methods.split(",") if m]
    configs = {m: parse_compression(m) for m in methods}
    exact = parse_compression("exact")
    speed = measure_compress_cost()
    print(f"codec speed on this CPU (one thread), ns per element: {json.dumps(speed.to_dict())}", file=sys.stderr)
    results: dict = {"bandwidth_scale": args.bandwidth_scale, "codec_speed": speed.to_dict(), "runs": {}}
    t0 = time.monotonic()
    with running_swarm("--scenario", "worldwide", "--peers", "8", "--bandwidth-scale", str(args.bandwidth_scale),
                       "--timeout", "600", *WAN_PLANE, kill=True, prefix="dtfm-bench-compress-") as run_dir:
        print(f"swarm up in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        reply, rows, view = train_run(run_dir, args.exact_steps)
        runs = {"exact": (reply, rows, view, exact)}
        shape = ("--stages", str(reply["stages"]), "--dp", str(reply["dp"]))
        print(f"exact: {reply['stages']} x {reply['dp']}, {len(rows)} steps logged", file=sys.stderr)
        for m in methods:
            r2, rows2, view2 = train_run(run_dir, args.steps, *shape, "--compress", m)
            runs[m] = (r2, rows2, view2, configs[m])
            print(f"{m}: {len(rows2)} steps logged"
                  + (f"; {r2['compress_links']['text']}" if "compress_links" in r2 else ""), file=sys.stderr)
    ex_reply, ex_rows, _, _ = runs["exact"]
    ex_phase = phases(ex_rows, args.skip)
    M = 4
    layers = max(b - a for a, b in ex_reply["layer_ranges"])
    layer_compute_s = ex_phase["compute_s"] / (M * layers) if ex_phase["compute_s"] else None
    results["layer_compute_s"] = layer_compute_s
    results["shape"] = f"{ex_reply['stages']}x{ex_reply['dp']}"
    for name, (reply, rows, view, config) in runs.items():
        period = config.inner_steps if config.dp_method == "diloco" else 1
        meas = cycle_iteration_s(rows, period, args.skip)
        pred = predict(view, reply, config, speed, layer_compute_s)
        pred_comm = predict(view, reply, config, speed, None)
        floor = predict(view, reply, config, speed, layer_compute_s, unlimited_bandwidth=True)
        floor_paper = predict(view, reply, config, speed, layer_compute_s, unlimited_bandwidth=True, engine_syncs=False)
        sweep = {f"{args.bandwidth_scale * f:.4g}": round(predict(view, reply, config, speed, layer_compute_s,
                                                                    bandwidth_factor=f)["iteration_s"], 4)
                 for f in SWEEP_FACTORS}
        results["runs"][name] = {
            "config": config.to_spec(), "steps_logged": len(rows), "allocation_predicted_s": reply["predicted_iteration_s"],
            "measured": meas, "phases": phases(rows, args.skip),
            "predicted_s": round(pred["iteration_s"], 4), "predicted_comm_only_s": round(pred_comm["iteration_s"], 4),
            "predicted_unlimited_bandwidth_s": round(floor["iteration_s"], 4),
            "predicted_unlimited_bandwidth_no_engine_syncs_s": round(floor_paper["iteration_s"], 4),
            "predicted_at_bandwidth_scale": sweep, "prediction": pred,
            "prediction_error": (round(relative_error(pred["iteration_s"], meas["iteration_s"]), 4)
                                 if meas["iteration_s"] else None),
            "pipelines": reply["pipelines"], "regions": reply["regions"],
            **({"compress_links": reply["compress_links"]["text"]} if "compress_links" in reply else {}),
            # the view the run was scheduled on, so a choice can be replayed offline
            "view": {"peers": list(view[0]), "delay_ms": _finite_rows(view[1], 3),
                     "bandwidth_gbps": _finite_rows(view[2], 6)},
        }
    ex_t = results["runs"]["exact"]["measured"]["iteration_s"]
    results["runs"]["exact"]["speedup_measured"] = 1.0
    for name in methods:
        r = results["runs"][name]
        t = r["measured"]["iteration_s"]
        r["speedup_measured"] = round(ex_t / t, 3) if ex_t and t else None
        r["speedup_predicted"] = round(results["runs"]["exact"]["predicted_s"] / r["predicted_s"], 3)
        med = r["measured"]["median_s"]
        r["speedup_bound"] = round(ex_t / r["predicted_unlimited_bandwidth_s"], 3) if ex_t else None
        r["speedup_predicted_at_bandwidth_scale"] = {
            k: round(results["runs"]["exact"]["predicted_at_bandwidth_scale"][k] / v, 3)
            for k, v in r["predicted_at_bandwidth_scale"].items()}
        r["speedup_of_medians"] = round(results["runs"]["exact"]["measured"]["median_s"] / med, 3) if med else None
    return results


def table(results: dict) -> None:
    rows = []
    for name, r in results["runs"].items():
        m, ph = r["measured"], r["phases"]
        b = ph["bytes_per_step"] or {}
        loc = "" if m["period"] == 1 else f" ({m['local_median_s']:.3f}, {m['sync_median_s']:.3f})"
        rows.append([name, r["config"], f"{m['iteration_s']:.3f}{loc}", f"{r['predicted_s']:.3f}",
                     f"{100 * r['prediction_error']:.1f} %", f"{r['predicted_comm_only_s']:.3f}",
                     f"{r['predicted_unlimited_bandwidth_s']:.3f}", ph["compute_s"], ph["pipeline_s"], ph["sync_s"],
                     f"{b.get('pp_fwd', 0):,}, {b.get('pp_bwd', 0):,}, {b.get('dp', 0):,}",
                     r.get("speedup_measured", "-")])
    print_table(["run", "config", "measured s/step (median; local, sync)", "predicted s", "error", "comm-only pred.",
                 "floor (unlimited bw)", "compute s", "pipeline s", "sync s", "bytes/step (pp fwd, pp bwd, dp)",
                 "speedup"], rows)
    scales = list(results["runs"]["exact"]["predicted_at_bandwidth_scale"])
    rows = []
    for name, r in results["runs"].items():
        sp = r.get("speedup_predicted_at_bandwidth_scale") or {}
        rows.append([name, f"{r['predicted_unlimited_bandwidth_s']:.3f}",
                     f"{r['predicted_unlimited_bandwidth_no_engine_syncs_s']:.3f}", r.get("speedup_bound", "-"),
                     *(sp.get(k, "-") for k in scales)])
    print_table(["run", "floor: unlimited bandwidth, s", "floor without the trainer's round trips, s",
                 "bound on the speedup (exact measured / floor)",
                 *(f"predicted speedup at scale {k}" for k in scales)], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bandwidth-scale", type=float, default=DEFAULT_SCALE)
    ap.add_argument("--methods", default="slow-link", help="compressed configurations, comma-separated "
                    "(`--compress` texts without commas: presets)")
    ap.add_argument("--recommended", default="slow-link", help="the method the JSON line's top level reports")
    ap.add_argument("--exact-steps", type=int, default=14)
    ap.add_argument("--steps", type=int, default=50, help="steps of each compressed run (3 DiLoCo cycles + skip)")
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of every figure")
    ap.add_argument("--out", default=None, help="write every figure to this JSON file")
    args = ap.parse_args(argv)
    if args.recommended not in args.methods.split(","):
        ap.error(f"--recommended {args.recommended} is not among --methods")
    results = run(args)
    table(results)
    if args.out:
        write_json(Path(args.out), results)
    rec = results["runs"][args.recommended]
    print(json.dumps({"recommended": args.recommended, "speedup_measured": rec["speedup_measured"],
                      "prediction_error": rec["prediction_error"], "bandwidth_scale": args.bandwidth_scale,
                      "speedup_goal": SPEEDUP_GOAL, "prediction_error_goal": PREDICTION_GOAL,
                      "shape": results["shape"],
                      "methods": [{"name": n, "speedup_measured": r.get("speedup_measured"),
                                   "prediction_error": r["prediction_error"],
                                   "measured_s": r["measured"]["iteration_s"], "predicted_s": r["predicted_s"]}
                                  for n, r in results["runs"].items()],
                      "runs": results["runs"], "codec_speed": results["codec_speed"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
