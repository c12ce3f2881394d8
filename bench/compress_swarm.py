"""Compressed vs exact training through the real daemons, measured: per step and in time to a
target loss (issue 19, part 3).

Eight `dtfm-peer` daemons on the emulated worldwide scenario (`dtfm-swarm up --scenario
worldwide --peers 8 --bandwidth-scale S`, the control plane's wan timings). Each repeat
(`--repeats`, 3 by default) starts a fresh swarm and runs on it: exact `tiny` for N steps
(`--exact-steps`) in the shape the swarm's scheduler picks, then each method for `--steps`
steps in the same shape (`dtfm-swarm train --stages S --dp D --compress NAME`); with `--stages
S` (a model that needs S stages) every run is asked for S stages only and the scheduler picks
each run's pipelines, a compressed run's by its predicted time to the target loss (`dtfm-swarm
train --stages S --compress NAME`: one pipeline when DP groups would cost more steps than they
save); with `--shape SxD` every run takes that shape; every run of a
repeat with the same training seed (the same batches), seed i in repeat i unless `--seeds`
says otherwise. Every figure is given per repeat and as mean, standard deviation, min and max
over the repeats.

The bandwidth scale S, unless `--bandwidth-scale` gives it: the scale at which exact `tiny` is
as bandwidth-bound as the paper's GPT-3 XL on its worldwide network, both by the simulator
(`dtfm.sched.simulate_iteration`). Bandwidth-bound share = the share of the predicted iteration
that goes away at unlimited bandwidth, 1 - iteration(unlimited bandwidth) / iteration
(docs/compression.md, "Communication share and bandwidth scale"): for GPT-3 XL the 8 x 8 allocation
the search finds for the paper's volumes, simulated with `gpt3-xl`'s compute (79.0 %); for
`tiny` the 8-peer scenario (one peer per city) in the shape the search picks with every peer
placed, global batch 16, M = 4, `--tiny-compute-s` of compute per iteration, with the
trainer's round trips (`engine_syncs`). The share falls as bandwidth grows; the scale is found
by bisection (`match_bandwidth_scale`), about 0.011.

Measured, per run: the iteration time from `train.jsonl` (`iteration_s`, the slowest peer's
step), the first `--skip` steps left out (connections warming up). A run whose DP groups
synchronise every H steps (DiLoCo) has two kinds of step; its iteration time is the cycle's
mean of the two medians, ((H - 1) x median of the local steps + median of the synchronising
steps) / H (`cycle_iteration_s`); with H = 1 the plain median. speedup per step = exact /
method, within a repeat.

Time to loss: every loss curve (`loss` of `train.jsonl`, the mean over the pipelines of the last
stage's training loss) is smoothed by the mean of the `--window` steps ending at each step (16,
one DiLoCo cycle). The target is exact's smoothed loss after N steps; a method's steps to
target are the steps its smoothed curve takes to reach it (`steps_to_reach`); step efficiency
= N / those steps (exact 1; `step_efficiency`; "not reached" when the method's run ends
first); time to target = steps to target x the run's iteration time, and its speedup = exact's
(N x exact's iteration time) / the method's. The wall-clock time to target is what a user
waits: the sum of the run's own step times up to the step that reaches it, every step counted
(the first ones, and a DiLoCo warm start's more frequent synchronisations, included:
`wall_time_to_step`), and its speedup exact's over the method's. Also given: the other reading of the same curves,
the steps exact needs for the method's own loss after N steps, over N
(`exact_equivalent_efficiency`).

Predicted: `dtfm.sched`'s GPipe simulator with the trainer's round trips (`engine_syncs`, as the
coordinator predicts) on the network view the daemons measured (read from a daemon's status),
for the run's own allocation, every link and DP group coding with the run's codec
(`CodecAssignment.uniform`; a per-link run, e.g. `auto`, with the coordinator's choice of links
and groups from the start's reply, `compress_links`), coding at the speed `measure_compress_cost()` measures on this
CPU (one thread), and compute at the rate the exact run computed (its slowest peer's
`compute_s` per step against the FLOPs of its layers at its M micro-batches: `measured_tflops`),
each run at its own micro-batch count. prediction_error = |predicted -
measured| / measured. Also printed: the same prediction without compute (what the
coordinator's `predicted_iteration_s` counts) and at unlimited bandwidth (latency, compute and
coding alone: the floor compression cannot go under).

    nice .venv/bin/python bench/compress_swarm.py [--methods exact,slow-link,auto] [--repeats 3]
        [--seeds 0,1,2] [--exact-steps 64] [--steps 112] [--window 16] [--bandwidth-scale S] [--skip 2]
        [--shape SxD | --stages S]
    nice .venv/bin/python bench/compress_swarm.py --simulate-overlap [--bandwidth-scale S]   # simulated only

Wall-clock figures share this machine's cores with whatever else runs. The last line is one
JSON object; `bench/compress.py --parts 3` runs this and merges it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from common import WAN_PLANE, print_table, read_rows, running_swarm, swarm, write_json
from compress_sched import tiny_spec

UNLIMITED_GBPS = 1e9  # "unlimited bandwidth" in the simulator
# Exact tiny's compute per iteration on the emulated swarm (the slowest peer's `compute_s`, the
# daemons on the 2-core development machine: 0.03-0.05 s, docs/compression.md); the computed
# scale is also given at both ends of that range.
TINY_COMPUTE_S = 0.04
TINY_COMPUTE_RANGE_S = (0.03, 0.05)
SPEEDUP_GOAL, PREDICTION_GOAL = 4.0, 0.25
SWEEP_FACTORS = (1.0, 0.5, 0.25, 0.1)  # simulated only: the measured view's bandwidths x these


# ---- pure helpers (tests/test_bench_compress_swarm.py) -------------------------------------------


def cycle_iteration_s(rows: list[dict], period: int, skip: int,
                      synchronises: Callable[[int], bool] | None = None) -> dict:
    """Iteration time of a run from its train.jsonl lines (dicts with `step`, `iteration_s`):
    steps before `skip` are left out; with `period` H > 1 the steps that synchronise
    (`synchronises(step)`, by default step + 1 a multiple of H; a DiLoCo run's warm start
    synchronises more often: `CompressionConfig.sync_due`) and the local ones are summarised
    apart and weighted by the steady cycle, ((H - 1) local + sync) / H, each the median of its
    kind. `iteration_s` None when the kept steps hold no step of a needed kind. `mean_s`: the
    plain mean of the kept steps (what a run whose exchange lands on a later step than it is
    sent, `dp_overlap_steps`, pays in all, the steps where it lands included)."""
    if period < 1:
        raise ValueError(f"period must be at least 1, got {period}")
    due = synchronises or (lambda step: (step + 1) % period == 0)
    kept = [r for r in rows if r.get("step", -1) >= skip and isinstance(r.get("iteration_s"), (int, float))]
    sync = [r["iteration_s"] for r in kept if due(r["step"])]
    local = [r["iteration_s"] for r in kept if not due(r["step"])]
    sync_med = statistics.median(sync) if sync else None
    local_med = statistics.median(local) if local else None
    if period == 1:
        it = sync_med
    elif sync_med is None or local_med is None:
        it = None
    else:
        it = ((period - 1) * local_med + sync_med) / period
    return {"iteration_s": it, "median_s": statistics.median([*sync, *local]) if kept else None,
            "mean_s": statistics.fmean([*sync, *local]) if kept else None,
            "sync_median_s": sync_med, "local_median_s": local_med, "sync_steps": len(sync),
            "local_steps": len(local), "period": period}


def bandwidth_bound_share(iteration_s: float, unlimited_bandwidth_s: float) -> float:
    """The share of an iteration that goes away at unlimited bandwidth: 1 - floor / iteration."""
    if not iteration_s > 0:
        raise ValueError(f"iteration time must be positive, got {iteration_s}")
    return 1.0 - unlimited_bandwidth_s / iteration_s


def match_bandwidth_scale(share_at: Callable[[float], float], target: float, lo: float = 1e-5,
                          hi: float = 10.0, rel_tol: float = 1e-6) -> float:
    """The bandwidth scale s in [lo, hi] at which `share_at(s)` equals `target`, by bisection on
    log s; `share_at` must fall as s grows (more bandwidth, less of the iteration bound by it).
    ValueError when the target lies outside [share_at(hi), share_at(lo)]."""
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got {lo}, {hi}")
    s_lo, s_hi = share_at(lo), share_at(hi)
    if not s_hi <= target <= s_lo:
        raise ValueError(f"a share of {target:.4f} is not reached between scales {lo:g} ({s_lo:.4f}) "
                         f"and {hi:g} ({s_hi:.4f})")
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if share_at(mid) > target else (lo, mid)
    return math.sqrt(lo * hi)


def smoothed_losses(rows: list[dict], window: int) -> dict[int, float]:
    """{step: mean loss of the `window` steps ending at it} from train.jsonl lines (dicts with
    `step`, `loss`), for every step whose window is complete (steps without a loss count as
    missing: their window is incomplete)."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    loss = {r["step"]: float(r["loss"]) for r in rows
            if isinstance(r.get("step"), int) and isinstance(r.get("loss"), (int, float))}
    out = {}
    for k in sorted(loss):
        w = [loss.get(j) for j in range(k - window + 1, k + 1)]
        if k - window + 1 >= 0 and all(v is not None for v in w):
            out[k] = statistics.fmean(w)  # type: ignore[arg-type]
    return out


def steps_to_reach(curve: dict[int, float], target: float) -> int | None:
    """Steps taken (last step + 1) when the smoothed curve first is at or below `target`; None
    when it never is."""
    for k in sorted(curve):
        if curve[k] <= target:
            return k + 1
    return None


def step_efficiency(exact_rows: list[dict], rows: list[dict], target_step: int, window: int) -> dict:
    """How many of exact's steps one step of a method is worth, read on the two runs' loss
    curves (each the mean of the `window` steps ending at a step). The target is exact's
    smoothed loss after `target_step` steps (N); `steps` is how many the method needs to reach
    it, and `efficiency` = N / steps (1 for exact by construction; None when the method's run
    never reaches the target). `exact_equivalent_steps`: the other reading, how many steps
    exact needs for the method's own loss after N steps (None when the method's run is shorter
    than N)."""
    ex = smoothed_losses(exact_rows, window)
    me = smoothed_losses(rows, window)
    if target_step - 1 not in ex:
        raise ValueError(f"exact's run holds no complete {window}-step window ending at step {target_step}")
    target = ex[target_step - 1]
    steps = steps_to_reach(me, target)
    own = me.get(target_step - 1)
    eq = steps_to_reach(ex, own) if own is not None else None
    return {"target_loss": target, "steps": steps, "efficiency": target_step / steps if steps else None,
            "loss_at_target_step": own, "exact_equivalent_steps": eq,
            "exact_equivalent_efficiency": eq / target_step if eq else None}


def wall_time_to_step(rows: list[dict], steps: int | None) -> float | None:
    """Seconds a run took for its first `steps` steps: the sum of `iteration_s` of steps 0 to
    steps - 1 (each step's time from the one before it ended, as train.jsonl logs it); None
    when `steps` is None or any of those steps has no time."""
    if not steps:
        return None
    times = {r["step"]: r["iteration_s"] for r in rows
             if isinstance(r.get("step"), int) and isinstance(r.get("iteration_s"), (int, float))}
    if any(k not in times for k in range(steps)):
        return None
    return float(sum(times[k] for k in range(steps)))


def spread(values: Iterable[float | None]) -> dict:
    """Mean, sample standard deviation, min and max of the figures that are not None (n counts
    them; `missing` the None ones)."""
    vals = list(values)
    got = [float(v) for v in vals if v is not None]
    if not got:
        return {"n": 0, "missing": len(vals), "mean": None, "stdev": None, "min": None, "max": None}
    return {"n": len(got), "missing": len(vals) - len(got), "mean": statistics.fmean(got),
            "stdev": statistics.stdev(got) if len(got) > 1 else 0.0, "min": min(got), "max": max(got)}


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


def run_config(reply: dict):
    """The training config of the run `reply` describes (its micro-batch count and pipeline
    schedule: the scheduler's)."""
    from dtfm.train import TrainConfig
    train = reply.get("train", {})
    return TrainConfig(micro_batches=int(train.get("micro_batches", TrainConfig().micro_batches)),
                       pipeline_warmups=str(train.get("pipeline_warmups", "")))


def measured_tflops(reply: dict, compute_s: float) -> float:
    """The rate (TFLOP/s) at which the run `reply` describes computed its layers, from its slowest
    peer's `compute_s` per step: what the prediction costs every run's compute at."""
    from dataclasses import replace

    from dtfm.control import sched_spec
    from dtfm.train import get_preset
    S, D = int(reply["stages"]), int(reply["dp"])
    cfg = run_config(reply)
    layers = max(b - a for a, b in reply["layer_ranges"])
    at_one = replace(sched_spec(get_preset("tiny"), cfg, D), reference_tflops=1.0).workload(S, D).layer_compute_s
    assert at_one is not None
    return at_one * cfg.micro_batches * layers / compute_s


def predict(view: tuple, reply: dict, config, speed, tflops: float | None, *,
            unlimited_bandwidth: bool = False, bandwidth_factor: float = 1.0, engine_syncs: bool = True) -> dict:
    """The simulator's iteration time of the run `reply` describes, coding with `config`, its
    compute at `tflops` (None: not costed)."""
    from dataclasses import replace

    from dtfm.control import sched_spec
    from dtfm.sched import CodecAssignment, CompressionOptions, CostModel, simulate_iteration, wire_codecs
    from dtfm.train import get_preset

    peers, delay, bw = view
    X = allocation_matrix(reply["pipelines"], peers)
    S, D = X.shape
    cfg = run_config(reply)
    mspec = sched_spec(get_preset("tiny"), cfg, D)
    if tflops is not None:
        mspec = replace(mspec, reference_tflops=tflops)
    pp, dp = wire_codecs(config)
    opts = CompressionOptions((pp,) if pp.exact else (type(pp)(), pp), (dp,) if dp.exact else (type(dp)(), dp), speed)
    if unlimited_bandwidth:
        bw = np.full_like(bw, 1e9)
    bw = bw * bandwidth_factor
    model = CostModel(delay, bw, mspec.workload(S, D), compression=opts)
    codecs = CodecAssignment.uniform(S, D, pp, dp)
    links = reply.get("compress_links")  # a per-link run: the coordinator's choice, from the allocation
    if links is not None:
        codecs = CodecAssignment.chosen(pp, dp, links["pp"], links["dp"])
    sim = simulate_iteration(model, X, micro_batches=cfg.micro_batches, engine_syncs=engine_syncs, codecs=codecs,
                             warmups=cfg.warmups(S))  # (the run's pipeline schedule, as the allocation carries it)
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


def gpt3_xl_bandwidth_share(seed: int = 0, time_budget_s: float = 10.0, generations: int = 20) -> dict:
    """GPT-3 XL on the paper's worldwide network by the simulator: the 8 x 8 allocation the
    search finds for the paper's volumes (`PAPER_GPT3_XL`), simulated with `gpt3-xl`'s compute
    (61 micro-batches of one sequence per pipeline), and at unlimited bandwidth."""
    from dtfm.scenarios import load_scenario
    from dtfm.sched import PAPER_GPT3_XL, PRESETS, cost_model, simulate_iteration, solve

    sc = load_scenario("worldwide")
    dl, bw, regions = sc.delay_ms(), sc.bandwidth_gbps(), sc.peer_regions()
    alloc = solve(dl, bw, PAPER_GPT3_XL, stages=8, dp=8, regions=regions, seed=seed, time_budget_s=time_budget_s,
                  generations=generations)
    it = simulate_iteration(cost_model(dl, bw, PRESETS["gpt3-xl"], 8, 8), alloc.matrix).iteration_s
    floor = simulate_iteration(cost_model(dl, np.full_like(bw, UNLIMITED_GBPS), PRESETS["gpt3-xl"], 8, 8),
                               alloc.matrix).iteration_s
    return {"iteration_s": float(it), "unlimited_bandwidth_s": float(floor),
            "bandwidth_bound_share": bandwidth_bound_share(it, floor)}


def tiny_share_at(compute_s: float, *, batch: int = 16, micro_batches: int = 4, seed: int = 0,
                  time_budget_s: float = 10.0, generations: int = 20) -> tuple[Callable[[float], float], dict]:
    """Exact `tiny` on the emulated worldwide swarm of 8 peers (one per city), in the shape the
    search picks on the scenario's matrices (every peer placed, as the swarm's first placement),
    with `compute_s` of compute per iteration and the trainer's round trips (`engine_syncs`):
    the function from a bandwidth scale to its bandwidth-bound share, and the shape."""
    from dtfm.scenarios import load_scenario
    from dtfm.sched import cost_model, simulate_iteration, solve

    sc = load_scenario("worldwide").scaled(8)
    dl, bw, regions = sc.delay_ms(), sc.bandwidth_gbps(), sc.peer_regions()
    shape = solve(dl, bw, tiny_spec(8, micro_batches, batch, None), stages="auto", regions=regions, seed=seed,
                  time_budget_s=time_budget_s, generations=generations, allow_spares=False)
    S, D = shape.stages, shape.dp
    spec = tiny_spec(D, micro_batches, batch, None)
    layer_s = compute_s / ((micro_batches + S - 1) * (spec.layers // S))
    spec = tiny_spec(D, micro_batches, batch, layer_s)

    def iteration(b: np.ndarray) -> float:
        return float(simulate_iteration(cost_model(dl, b, spec, S, D), shape.matrix, micro_batches=micro_batches,
                                        engine_syncs=True).iteration_s)

    floor = iteration(np.full_like(bw, UNLIMITED_GBPS))
    info = {"shape": f"{S}x{D}", "pipelines": [[regions[i] for i in p] for p in shape.pipelines],
            "compute_s": compute_s, "unlimited_bandwidth_s": floor}
    return (lambda scale: bandwidth_bound_share(iteration(bw * scale), floor)), info


def computed_scale(args) -> dict:
    """The bandwidth scale at which exact `tiny` (`tiny_share_at`) is as bandwidth-bound as
    GPT-3 XL on the paper's worldwide network (`gpt3_xl_bandwidth_share`), with the scales the
    compute figure's range gives."""
    xl = gpt3_xl_bandwidth_share(args.seed, args.time_budget)
    target = xl["bandwidth_bound_share"]
    share_at, info = tiny_share_at(args.tiny_compute_s, seed=args.seed, time_budget_s=args.time_budget)
    scale = match_bandwidth_scale(share_at, target)
    band = {}
    for c in TINY_COMPUTE_RANGE_S:
        f, _ = tiny_share_at(c, seed=args.seed, time_budget_s=args.time_budget)
        band[f"{c:g}"] = round(match_bandwidth_scale(f, target), 5)
    return {"scale": scale, "gpt3_xl": xl, "tiny": {**info, "share_at_scale": share_at(scale)},
            "scale_at_compute_s": band}


def _repeat(args, methods: list[str], configs: dict, exact, seed: int) -> dict:
    """One fresh swarm: exact for N steps in the shape the swarm's scheduler picks, then each
    method for `--steps` steps in the same shape, all with the training seed `seed`. With
    `--stages S`, every run is asked for S stages only and the scheduler picks its pipelines
    (each method's own, by its time to the target loss)."""
    t0 = time.monotonic()
    with running_swarm("--scenario", "worldwide", "--peers", "8", "--bandwidth-scale", f"{args.bandwidth_scale:.6g}",
                       "--timeout", "600", *WAN_PLANE, kill=True, prefix="dtfm-bench-compress-") as run_dir:
        print(f"swarm up in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        forced = (("--stages", args.shape.split("x")[0], "--dp", args.shape.split("x")[1]) if args.shape
                  else ("--stages", str(args.stages)) if args.stages else ())
        reply, rows, view = train_run(run_dir, args.exact_steps, *forced, "--seed", str(seed))
        runs = {"exact": (reply, rows, view, exact)}
        shape = (("--stages", str(args.stages)) if args.stages and not args.shape
                 else ("--stages", str(reply["stages"]), "--dp", str(reply["dp"])))
        print(f"exact: {reply['stages']} x {reply['dp']}, {len(rows)} steps logged", file=sys.stderr)
        for m in methods:
            r2, rows2, view2 = train_run(run_dir, args.steps, *shape, "--seed", str(seed), "--compress", m)
            runs[m] = (r2, rows2, view2, configs[m])
            print(f"{m}: {r2['stages']} x {r2['dp']}, {len(rows2)} steps logged"
                  + (f"; {r2['compress_links']['text']}" if "compress_links" in r2 else ""), file=sys.stderr)
    return runs


def _figures(args, runs: dict, speed, methods: list[str]) -> dict:
    """Every figure of one repeat's runs (see the module's docstring)."""
    ex_reply, ex_rows, _, _ = runs["exact"]
    ex_phase = phases(ex_rows, args.skip)
    tflops = measured_tflops(ex_reply, ex_phase["compute_s"]) if ex_phase["compute_s"] else None
    out: dict = {"measured_tflops": tflops, "shape": f"{ex_reply['stages']}x{ex_reply['dp']}", "runs": {}}
    for name, (reply, rows, view, config) in runs.items():
        period = config.inner_steps if config.dp_method == "diloco" and reply["dp"] > 1 else 1
        meas = cycle_iteration_s(rows, period, args.skip, config.sync_due if period > 1 else None)
        pred = predict(view, reply, config, speed, tflops)
        pred_comm = predict(view, reply, config, speed, None)
        floor = predict(view, reply, config, speed, tflops, unlimited_bandwidth=True)
        floor_paper = predict(view, reply, config, speed, tflops, unlimited_bandwidth=True, engine_syncs=False)
        sweep = {f"{args.bandwidth_scale * f:.4g}": round(predict(view, reply, config, speed, tflops,
                                                                    bandwidth_factor=f)["iteration_s"], 4)
                 for f in SWEEP_FACTORS}
        loss = None
        if args.exact_steps >= args.window:
            loss = step_efficiency(ex_rows, rows, args.exact_steps, args.window)
        out["runs"][name] = {
            "config": config.to_spec(), "steps_logged": len(rows), "allocation_predicted_s": reply["predicted_iteration_s"],
            "measured": meas, "phases": phases(rows, args.skip),
            "predicted_s": round(pred["iteration_s"], 4), "predicted_comm_only_s": round(pred_comm["iteration_s"], 4),
            "predicted_unlimited_bandwidth_s": round(floor["iteration_s"], 4),
            "predicted_unlimited_bandwidth_no_engine_syncs_s": round(floor_paper["iteration_s"], 4),
            "predicted_at_bandwidth_scale": sweep, "prediction": pred,
            "prediction_error": (round(relative_error(pred["iteration_s"], meas["iteration_s"]), 4)
                                 if meas["iteration_s"] else None),
            # the coordinator's own prediction, the one `train start` prints (its compute from
            # each peer's gossiped figure and this machine's measured slowdown)
            "allocation_prediction_error": (round(relative_error(reply["predicted_iteration_s"],
                                                                 meas["iteration_s"]), 4)
                                            if meas["iteration_s"] else None),
            "loss": loss, "losses": [r.get("loss") for r in sorted(rows, key=lambda r: r["step"])],
            "shape": f"{reply['stages']}x{reply['dp']}", "shape_note": reply.get("shape_note", ""),
            "pipelines": reply["pipelines"], "regions": reply["regions"],
            **({"compress_links": reply["compress_links"]["text"]} if "compress_links" in reply else {}),
            # the view the run was scheduled on, so a choice can be replayed offline
            "view": {"peers": list(view[0]), "delay_ms": _finite_rows(view[1], 3),
                     "bandwidth_gbps": _finite_rows(view[2], 6)},
        }
    ex = out["runs"]["exact"]
    ex_t = ex["measured"]["iteration_s"]
    ex["speedup_measured"] = 1.0
    if ex["loss"] is not None and ex_t:
        ex["loss"]["efficiency"] = 1.0  # the reference: exact reaches its own loss at N by definition
        ex["loss"]["steps"] = args.exact_steps
        ex["time_to_target_s"] = args.exact_steps * ex_t
    ex["wall_time_to_target_s"] = wall_time_to_step(ex_rows, args.exact_steps)
    ex["wall_time_to_target_speedup"] = 1.0 if ex["wall_time_to_target_s"] else None
    for name in methods:
        r = out["runs"][name]
        t = r["measured"]["iteration_s"]
        r["speedup_measured"] = round(ex_t / t, 3) if ex_t and t else None
        r["speedup_predicted"] = round(ex["predicted_s"] / r["predicted_s"], 3)
        med = r["measured"]["median_s"]
        r["speedup_bound"] = round(ex_t / r["predicted_unlimited_bandwidth_s"], 3) if ex_t else None
        r["speedup_predicted_at_bandwidth_scale"] = {
            k: round(ex["predicted_at_bandwidth_scale"][k] / v, 3) for k, v in r["predicted_at_bandwidth_scale"].items()}
        r["speedup_of_medians"] = round(ex["measured"]["median_s"] / med, 3) if med else None
        steps = (r["loss"] or {}).get("steps")
        r["time_to_target_s"] = steps * t if steps and t else None
        r["time_to_target_speedup"] = (ex["time_to_target_s"] / r["time_to_target_s"]
                                       if r["time_to_target_s"] and ex.get("time_to_target_s") else None)
        r["wall_time_to_target_s"] = wall_time_to_step(runs[name][1], steps)
        r["wall_time_to_target_speedup"] = (ex["wall_time_to_target_s"] / r["wall_time_to_target_s"]
                                            if r["wall_time_to_target_s"] and ex["wall_time_to_target_s"] else None)
    return out


def summarise(repeats: list[dict], names: list[str]) -> dict:
    """Per method, the mean and spread over the repeats of the per-step speedup, the step
    efficiency, the time to the target loss and its speedup, and the prediction error."""
    out = {}
    for n in names:
        rs = [rep["runs"][n] for rep in repeats]
        out[n] = {
            "iteration_s": spread(r["measured"]["iteration_s"] for r in rs),
            "speedup_per_step": spread(r["speedup_measured"] for r in rs),
            "step_efficiency": spread((r["loss"] or {}).get("efficiency") for r in rs),
            "exact_equivalent_efficiency": spread((r["loss"] or {}).get("exact_equivalent_efficiency") for r in rs),
            "time_to_target_s": spread(r.get("time_to_target_s") for r in rs),
            "time_to_target_speedup": spread(1.0 if n == "exact" and r.get("time_to_target_s") else
                                             r.get("time_to_target_speedup") for r in rs),
            "prediction_error": spread(r["prediction_error"] for r in rs),
            "allocation_prediction_error": spread(r.get("allocation_prediction_error") for r in rs),
            "wall_time_to_target_s": spread(r.get("wall_time_to_target_s") for r in rs),
            "wall_time_to_target_speedup": spread(r.get("wall_time_to_target_speedup") for r in rs),
        }
    return out


def repeat_seeds(text: str, repeats: int) -> list[int]:
    """The training seed of each repeat: `--seeds` (comma-separated, used in turn), or by default
    seed i for repeat i, so the loss figures carry seed-to-seed spread (a repeat's runs share
    its seed: methods are compared on the same batches)."""
    if not text:
        return list(range(repeats))
    seeds = [int(x) for x in text.split(",") if x.strip()]
    if not seeds or any(x < 0 for x in seeds):
        raise ValueError(f"--seeds needs non-negative integers, got {text!r}")
    return [seeds[i % len(seeds)] for i in range(repeats)]


def method_names(text: str) -> list[str]:
    """The compressed methods of `--methods`: exact always runs first, as the reference. Methods
    are separated by commas, or by semicolons when one has options
    ("slow-link;slow-link,dp_overlap_steps=1")."""
    return [m.strip() for m in text.split(";" if ";" in text else ",") if m.strip() and m.strip() != "exact"]


def simulated_overlap(args, overlaps: Iterable[int] = (0, 1, 2), first_steps: int = 112) -> dict:
    """SIMULATED, no daemons: `slow-link` and `diloco` on the emulated worldwide swarm of 8 (the
    scenario's matrices at the bandwidth scale, the shape and allocation the search picks for
    exact `tiny`, `--tiny-compute-s` of compute, the trainer's round trips, the reference CPU's
    coding speed) with the DP exchange overlapping 0, 1, 2 inner steps: the predicted iteration
    (the mean over a steady DiLoCo cycle of H steps, and the mean over the run's first
    `first_steps` steps, the warm start's frequent synchronisations included: local step +
    synchronisations in those steps / steps x what a synchronising step adds) and what each
    overlap buys."""
    from dtfm.scenarios import load_scenario
    from dtfm.sched import (REFERENCE_CODEC_SPEED, CodecAssignment, CompressionOptions, CostModel, simulate_iteration,
                            solve, wire_codecs)
    from dtfm.train.compress import parse_compression

    sc = load_scenario("worldwide").scaled(8)
    dl, bw, regions = sc.delay_ms(), sc.bandwidth_gbps() * args.bandwidth_scale, sc.peer_regions()
    M, batch = 4, 16
    shape = solve(sc.delay_ms(), sc.bandwidth_gbps(), tiny_spec(8, M, batch, None), stages="auto", regions=regions,
                  seed=args.seed, time_budget_s=args.time_budget, generations=20, allow_spares=False)
    S, D = shape.stages, shape.dp
    spec = tiny_spec(D, M, batch, None)
    spec = tiny_spec(D, M, batch, args.tiny_compute_s / ((M + S - 1) * (spec.layers // S)))
    out: dict = {"shape": f"{S}x{D}", "pipelines": [[regions[i] for i in p] for p in shape.pipelines],
                 "bandwidth_scale": args.bandwidth_scale, "methods": {}}
    for name in ("slow-link", "diloco"):
        row = {}
        for tau in overlaps:
            config = parse_compression(f"{name},dp_overlap_steps={tau}")
            pp, dp = wire_codecs(config)
            opts = CompressionOptions((pp,) if pp.exact else (type(pp)(), pp), (type(dp)(), dp), REFERENCE_CODEC_SPEED)
            model = CostModel(dl, bw, spec.workload(S, D), compression=opts)
            sim = simulate_iteration(model, shape.matrix, micro_batches=M, engine_syncs=True,
                                     codecs=CodecAssignment.uniform(S, D, pp, dp))
            local = sim.local_iteration_s if sim.local_iteration_s is not None else sim.iteration_s
            added = config.inner_steps * (sim.iteration_s - local)  # what one synchronising step adds
            row[str(tau)] = {"iteration_s": round(float(sim.iteration_s), 4), "local_s": round(float(local), 4),
                             f"first_{first_steps}_s": round(local + config.syncs_in(first_steps) / first_steps * added,
                                                             4),
                             "sync_s": [round(float(a), 4) for a in sim.exposed_sync_s],
                             "exchange_s": [round(float(a), 4) for a in sim.allreduce_s]}
        base, base_first = row["0"]["iteration_s"], row["0"][f"first_{first_steps}_s"]
        for tau, r in row.items():
            r["saving_s"] = round(base - r["iteration_s"], 4)
            r["speedup"] = round(base / r["iteration_s"], 4)
            r[f"first_{first_steps}_speedup"] = round(base_first / r[f"first_{first_steps}_s"], 4)
        out["methods"][name] = row
    return out


def run(args) -> dict:
    import torch

    from dtfm.train.compress import measure_compress_cost, parse_compression

    torch.set_num_threads(1)
    methods = method_names(args.methods)
    configs = {m: parse_compression(m) for m in methods}
    exact = parse_compression("exact")
    results: dict = {"target_step": args.exact_steps, "window": args.window, "steps": args.steps}
    if args.bandwidth_scale is None:
        sc = computed_scale(args)
        args.bandwidth_scale = sc["scale"]
        results["scale"] = sc
        print(f"GPT-3 XL on worldwide (8 x 8, simulated): {sc['gpt3_xl']['iteration_s']:.3f} s per iteration, "
              f"{sc['gpt3_xl']['unlimited_bandwidth_s']:.3f} s at unlimited bandwidth: "
              f"{100 * sc['gpt3_xl']['bandwidth_bound_share']:.1f} % bandwidth-bound; exact tiny "
              f"({sc['tiny']['shape']}, {args.tiny_compute_s} s compute) is as bound at --bandwidth-scale "
              f"{sc['scale']:.4g} (at {', '.join(f'{k} s: {v:g}' for k, v in sc['scale_at_compute_s'].items())})",
              file=sys.stderr)
    results["bandwidth_scale"] = args.bandwidth_scale
    speed = measure_compress_cost()
    results["codec_speed"] = speed.to_dict()
    print(f"codec speed on this CPU (one thread), ns per element: {json.dumps(speed.to_dict())}", file=sys.stderr)
    repeats: list[dict] = []
    failed: list[dict] = []
    results["repeats"], results["failed"] = repeats, failed
    for i, seed in enumerate(repeat_seeds(args.seeds, args.repeats)):
        print(f"repeat {i + 1} of {args.repeats}, seed {seed}", file=sys.stderr)
        try:
            rep = {"seed": seed, **_figures(args, _repeat(args, methods, configs, exact, seed), speed, methods)}
        except RuntimeError as e:  # (a swarm that stopped its run: said, kept, and the next repeat goes on)
            print(f"repeat {i + 1} failed: {e}", file=sys.stderr)
            failed.append({"seed": seed, "error": str(e)[-2000:]})
            continue
        repeats.append(rep)
        print(f"repeat {i + 1}: " + "; ".join(
            f"{n} {r['measured']['iteration_s']:.3f} s/step, target "
            + (f"in {r['time_to_target_s']:.1f} s" if r.get("time_to_target_s") else "not reached")
            + (f" ({r['time_to_target_speedup']:.2f}x)" if r.get("time_to_target_speedup") else "")
            + (f", {r['wall_time_to_target_s']:.1f} s on the clock" if r.get("wall_time_to_target_s") else "")
            for n, r in rep["runs"].items()), file=sys.stderr)
        if args.out:  # (what is measured so far, should a later repeat not end)
            write_json(Path(args.out), results)
    if not repeats:
        raise RuntimeError(f"every repeat failed; the last: {failed[-1]['error']}")
    results["summary"] = summarise(repeats, ["exact", *methods])
    return results


def _fmt(sp: dict, digits: int = 3, pct: bool = False) -> str:
    """`mean (min-max)` of a `spread`, `-` when empty."""
    if not sp["n"]:
        return "-"
    f = (lambda v: f"{100 * v:.{max(digits - 2, 0)}f} %") if pct else (lambda v: f"{v:.{digits}f}")
    miss = f", {sp['missing']} not reached" if sp["missing"] else ""
    return f"{f(sp['mean'])} ({f(sp['min'])}-{f(sp['max'])}{miss})"


def table(results: dict) -> None:
    for i, rep in enumerate(results["repeats"]):
        rows = []
        for name, r in rep["runs"].items():
            m, ph = r["measured"], r["phases"]
            b = ph["bytes_per_step"] or {}
            loc = "" if m["period"] == 1 else f" ({m['local_median_s']:.3f}, {m['sync_median_s']:.3f})"
            lo = r["loss"] or {}
            rows.append([f"{i + 1} (seed {rep.get('seed', 0)}): {name}", f"{m['iteration_s']:.3f}{loc}", f"{r['predicted_s']:.3f}",
                         f"{100 * r['prediction_error']:.1f} %", f"{r['predicted_unlimited_bandwidth_s']:.3f}",
                         ph["compute_s"], f"{b.get('pp_fwd', 0):,}, {b.get('pp_bwd', 0):,}, {b.get('dp', 0):,}",
                         r.get("speedup_measured", "-"), lo.get("steps", "-"),
                         f"{lo['efficiency']:.3f}" if lo.get("efficiency") else "-",
                         f"{r['time_to_target_s']:.1f}" if r.get("time_to_target_s") else "-",
                         f"{r['wall_time_to_target_s']:.1f}" if r.get("wall_time_to_target_s") else "-",
                         r.get("compress_links", "")])
        print_table(["repeat: run", "measured s/step (local, sync)", "predicted s", "error", "floor (unlimited bw)",
                     "compute s", "bytes/step (pp fwd, pp bwd, dp)", "speedup per step", "steps to target",
                     "step efficiency", "time to target s", "on the clock s", "links"], rows)
    print_table(["run", "s/step", "speedup per step", "step efficiency", "time to target s",
                 "speedup in time to target", "on the clock s", "speedup on the clock", "prediction error",
                 "coordinator's prediction error"],
                ([n, _fmt(s["iteration_s"]), _fmt(s["speedup_per_step"], 2), _fmt(s["step_efficiency"], 2),
                  _fmt(s["time_to_target_s"], 1), _fmt(s["time_to_target_speedup"], 2),
                  _fmt(s["wall_time_to_target_s"], 1), _fmt(s["wall_time_to_target_speedup"], 2),
                  _fmt(s["prediction_error"], 3, pct=True), _fmt(s["allocation_prediction_error"], 3, pct=True)]
                 for n, s in results["summary"].items()))


def json_line(results: dict, recommended: str) -> dict:
    """The last line's object: `recommended`'s figures at the top level (the means over the
    repeats: what bench/compress.py merges), then per method the means and the spreads."""
    summ = results["summary"]
    rec = summ[recommended]
    best = max((n for n in summ if n != "exact"), key=lambda n: summ[n]["time_to_target_speedup"]["mean"] or 0.0)
    return {"recommended": recommended, "speedup_measured": rec["speedup_per_step"]["mean"],
            "prediction_error": rec["prediction_error"]["mean"], "bandwidth_scale": results["bandwidth_scale"],
            "bandwidth_scale_computed": "scale" in results,
            "speedup_goal": SPEEDUP_GOAL, "prediction_error_goal": PREDICTION_GOAL,
            "target_step": results["target_step"], "window": results["window"], "repeats": len(results["repeats"]),
            "failed_repeats": results.get("failed", []),
            "best_time_to_target": best, "best_time_to_target_speedup": summ[best]["time_to_target_speedup"]["mean"],
            "best_wall_time_to_target_speedup": summ[best]["wall_time_to_target_speedup"]["mean"],
            "shape": results["repeats"][0]["shape"],
            "methods": [{"name": n, "speedup_measured": s["speedup_per_step"]["mean"],
                         "prediction_error": s["prediction_error"]["mean"], "measured_s": s["iteration_s"]["mean"],
                         "predicted_s": statistics.fmean(rep["runs"][n]["predicted_s"] for rep in results["repeats"]),
                         "prediction_error_spread": s["prediction_error"],
                         **{k: s[k] for k in ("speedup_per_step", "step_efficiency", "time_to_target_s",
                                              "time_to_target_speedup", "wall_time_to_target_s",
                                              "wall_time_to_target_speedup")}}
                        for n, s in summ.items()],
            "scale": results.get("scale"), "codec_speed": results["codec_speed"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bandwidth-scale", type=float, default=None,
                    help="the swarm's bandwidth scale; unset: computed (see the module's docstring)")
    ap.add_argument("--tiny-compute-s", type=float, default=TINY_COMPUTE_S,
                    help="exact tiny's compute per iteration, for the computed scale")
    ap.add_argument("--time-budget", type=float, default=10.0, help="seconds of search per allocation (the scale)")
    ap.add_argument("--seed", type=int, default=0, help="the search's seed (the scale)")
    ap.add_argument("--methods", default="slow-link", help="compressed configurations, comma-separated "
                    "(`--compress` texts without commas: presets), or semicolon-separated `--compress` texts "
                    "(\"slow-link;slow-link,dp_overlap_steps=1\")")
    ap.add_argument("--shape", default=None, metavar="SxD",
                    help="run exact (and so every method) as S stages x D pipelines; unset: the shape the swarm's "
                         "scheduler picks for exact (which may leave peers out: 1 x 1 on a loaded machine)")
    ap.add_argument("--stages", type=int, default=None, metavar="S",
                    help="ask every run for S stages only (a model that needs S stages): the scheduler picks "
                         "each run's pipelines, a compressed run's by its time to the target loss")
    ap.add_argument("--simulate-overlap", action="store_true",
                    help="only predict, without daemons, what overlapping the DiLoCo exchange with 0, 1 and 2 "
                         "inner steps gives on this scale (`simulated_overlap`) and exit")
    ap.add_argument("--recommended", default="slow-link", help="the method the JSON line's top level reports")
    ap.add_argument("--repeats", type=int, default=3, help="fresh swarms, each running every method once")
    ap.add_argument("--seeds", default="", help="training seeds of the repeats, comma-separated, used in turn "
                    "(default: seed i for repeat i; `--seeds 0`: the same seed every time)")
    ap.add_argument("--exact-steps", type=int, default=64, metavar="N",
                    help="steps of the exact run; its smoothed loss at N is the target")
    ap.add_argument("--steps", type=int, default=112, help="steps of each compressed run (long enough to reach "
                    "the target: N / step efficiency)")
    ap.add_argument("--window", type=int, default=16, help="steps of the trailing mean that smooths every loss curve")
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of every time")
    ap.add_argument("--out", default=None, help="write every figure to this JSON file")
    args = ap.parse_args(argv)
    if args.simulate_overlap:
        if args.bandwidth_scale is None:
            args.bandwidth_scale = computed_scale(args)["scale"]
        res = simulated_overlap(args)
        print(f"SIMULATED: tiny {res['shape']} on the worldwide 8 at bandwidth x {res['bandwidth_scale']:.4g}, "
              f"{args.tiny_compute_s} s compute", file=sys.stderr)
        print_table(["method", "overlap steps", "predicted s/iter (steady cycle)", "sync-step DP cost per stage (s)",
                     "saving (s/iter)", "speedup", "mean of the first 112 steps (s)", "speedup there"],
                    [[m, tau, r["iteration_s"], ", ".join(f"{a:.3f}" for a in r["sync_s"]), r["saving_s"], r["speedup"],
                      r["first_112_s"], r["first_112_speedup"]]
                     for m, row in res["methods"].items() for tau, r in row.items()])
        if args.out:
            write_json(Path(args.out), res)
        print(json.dumps(res))
        return 0
    if args.recommended not in method_names(args.methods):
        ap.error(f"--recommended {args.recommended} is not among --methods")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.shape and not (len(args.shape.split("x")) == 2 and all(x.isdigit() and int(x) > 0
                                                                   for x in args.shape.split("x"))):
        ap.error(f"--shape takes SxD, e.g. 4x2, got {args.shape!r}")
    if args.shape and args.stages:
        ap.error("--shape fixes both stages and pipelines: give --shape or --stages, not both")
    if args.stages is not None and args.stages < 1:
        ap.error(f"--stages must be at least 1, got {args.stages}")
    try:
        repeat_seeds(args.seeds, args.repeats)
    except ValueError as e:
        ap.error(str(e))
    results = run(args)
    table(results)
    if args.out:
        write_json(Path(args.out), results)
    print(json.dumps(json_line(results, args.recommended)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
