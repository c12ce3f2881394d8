"""Compressed training vs exact (issue 19, parts 1 to 3; judged as issue 28 asks).

Parts 1 and 2, in one process: every method trains the same model from the same seed on the
same data for the same steps through `LocalCluster` (S stages x D pipelines on the in-memory
Comm), whose Comm counts the payload bytes each peer sends per axis: pipeline forward
(activations), pipeline backward (activation gradients), data-parallel, other (loss, norm).
`--seeds 0,1,2` runs every method on each seed. A run is judged by the held-out loss of its
synchronised model: the mean over the DP replicas' weights at each of its last `--eval-points`
synchronised steps (right after a DiLoCo synchronisation, where the replicas are identical;
every `--eval-every` steps for methods synchronised every step), on `--heldout-windows` fixed
windows of the corpus's last MiB (held out: never trained on), averaged over those
points; and by the mean training loss of its last `--last` steps. Reported per method: the mean,
min-max and stdev of both over the seeds, each mean's gap to exact's mean and the gaps paired
by seed, bytes per step per axis and the ratios exact / method, and the wall time.
`--finetune-from-steps K` first trains exact K steps per seed, then runs every method `--steps`
more from that state (a fine-tune from an exact checkpoint), judged the same way. Loss curves
go to `<out>/loss.png` (with matplotlib), every figure to `<out>/results.json` (written after
each run, so a cut run keeps the runs it finished).

Part 3, through the daemons: `bench/compress_swarm.py` (run as its own process) starts 8
daemons on the emulated worldwide scenario at `--bandwidth-scale`, trains exact `tiny` and
each of `--swarm-methods` on that swarm, and measures the iteration time of each and the
simulator's error on the compressed run; its figures go to `<out>/swarm.json`.

    nice .venv/bin/python bench/compress.py [--parts 1,2,3] [--steps 600] [--seeds 0,1,2] [--stages 2] [--dp 4] [--methods exact,pp-int4,...]

The last line is one JSON object: the recommended configuration's pp_bytes_ratio,
dp_bytes_ratio, total_bytes_ratio, loss_gap (= heldout_gap: the held-out gap of the means over
the seeds) and train_gap (parts 1 and 2), speedup_measured, prediction_error and
bandwidth_scale (part 3), and a `methods` list with the same keys per method plus the spreads;
keys of a part that did not run are null. Part 4 (the scheduler's choice) is
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

import numpy as np

from dtfm.train import Corpus, GPTStage, LocalCluster, Plan, StageState, TrainConfig, get_preset, load_corpus
from dtfm.train.compress import (AXES, COMPRESSION_PRESETS, DEFAULT_SLOW_LINK, CompressionConfig, get_compression,
                                 outer_step)

from common import print_table, write_json

PP_GOAL, DP_GOAL, LOSS_GOAL = 7.0, 100.0, 0.02
SPEEDUP_GOAL, PREDICTION_GOAL = 4.0, 0.25
HERE = Path(__file__).resolve().parent
PARTS = ("1", "2", "3")
DEFAULT_METHODS = ("exact", "pp-int8", "pp-int4", "cocktail", "diloco", DEFAULT_SLOW_LINK)


HELDOUT_BYTES = 1 << 20  # the corpus's last MiB, never trained on: the held-out windows are drawn from it


def split_corpus() -> tuple[Corpus, np.ndarray]:
    """The training corpus (the default corpus, the standard library's source, but its last
    `HELDOUT_BYTES`) and the held-out tokens (those last bytes)."""
    whole = load_corpus()
    if len(whole.tokens) < 4 * HELDOUT_BYTES:
        raise SystemExit(f"corpus {whole.name} is too small to hold {HELDOUT_BYTES} bytes out")
    cut = len(whole.tokens) - HELDOUT_BYTES
    return Corpus(whole.tokens[:cut].copy(), f"{whole.name} but its last {HELDOUT_BYTES} bytes"), whole.tokens[cut:]


def heldout_windows(tokens: np.ndarray, n: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n fixed windows, evenly spaced over the held-out tokens: inputs and targets, (n, seq_len) each."""
    hi = len(tokens) - seq_len - 1
    offs = [i * hi // max(1, n - 1) for i in range(n)]
    win = torch.from_numpy(np.stack([tokens[o:o + seq_len + 1] for o in offs]).astype(np.int64))
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def synchronised_model(cl: LocalCluster) -> tuple[dict[str, torch.Tensor], bool]:
    """Every parameter of the whole model as the mean over the DP replicas of its stage, and
    whether the replicas were identical (right after a synchronisation, or any exact step).
    Right after an overlapped DiLoCo synchronisation is sent (`dp_overlap_steps`), each stage's
    parameters are instead the anchor that exchange will land (the outer step of the group's
    decoded mean, the same bits on every replica): the synchronised model of the same steps
    as a synchronisation that waits, where the replicas have not applied it yet."""
    comp, step = cl.compression, cl.step_index - 1  # the step just run
    landing = comp.overlap_of(step) > 0
    by_stage: dict[int, list[str]] = {}
    for p in cl.plan.peers:
        by_stage.setdefault(cl.plan.position(p)[1], []).append(p)
    out, same = {}, True
    for peers in by_stage.values():
        if landing:
            members = [cl.states[p].compress for p in cl.plan.dp_group(cl.plan.position(peers[0])[1])]
            total = members[0].in_flight_contribution().clone()
            for m in members[1:]:
                total += m.in_flight_contribution()
            avg = total / torch.full((), len(members), dtype=total.dtype)
            ref = members[0]
            anchor = outer_step(comp, step, ref.buffers["anchor"], ref.buffers.get("outer_m"), avg)[0]
            out.update(ref.state_views(anchor))
            continue
        reps = [{n: t.detach() for n, t in cl.states[p].params.items()} for p in peers]
        for n in reps[0]:
            ts = [r[n] for r in reps]
            same = same and all(torch.equal(ts[0], t) for t in ts[1:])
            out[n] = torch.stack(ts).mean(0)
    return out, same


@torch.no_grad()
def heldout_loss(spec, params: dict[str, torch.Tensor], windows: tuple[torch.Tensor, torch.Tensor],
                 batch: int = 32) -> float:
    """Mean cross-entropy (nats per token) of the model with `params` on the held-out windows."""
    model = GPTStage(spec, (0, spec.n_layer), 0)
    for n, p in model.named_parameters():
        p.copy_(params[n])
    model.eval()
    x, y = windows
    total = 0.0
    for i in range(0, len(x), batch):
        total += float(model(x[i:i + batch], y[i:i + batch])) * len(x[i:i + batch])
    return total / len(x)


def eval_points(comp: CompressionConfig, steps: int, first_step: int, points: int, every: int) -> list[int]:
    """The last `points` step counts (steps run so far, from `first_step`) at which the run's
    replicas are synchronised: after a compressed synchronisation for a DiLoCo run, else the
    last step and every `every` steps back from it (exact, cocktail and the pipeline codecs are
    synchronised after every step; with `every` = H those are a DiLoCo preset's points too)."""
    end = first_step + steps
    if comp.dp_method == "diloco":
        return [k + 1 for k in range(first_step, end) if comp.sync_due(k)][-points:]
    return [n for n in range(end - (points - 1) * every, end + 1, every) if n > first_step]


def exact_start(spec, cfg: TrainConfig, plan: Plan, corpus: Corpus, steps: int) -> dict:
    """Every peer's stage after `steps` exact steps (the fine-tunes' common start)."""
    with LocalCluster(spec, cfg, plan, corpus) as cl:
        for _ in range(steps):
            cl.step()
        cl.settle()
        return cl.states


def states_from(start: dict, spec, cfg: TrainConfig, comp: CompressionConfig) -> dict:
    """Fresh stages compressed with `comp` holding the weights, optimizer moments and step of
    `start` (DiLoCo's anchor: those weights; residual and outer momentum: zero)."""
    out = {}
    for p, st in start.items():
        new = StageState(spec, cfg, st.layer_range, "cpu", comp)
        with torch.no_grad():
            for n, t in new.params.items():
                t.copy_(st.params[n])
        new.optim.load_state_tensors(st.optim.state_tensors(), st.optim.step_count)
        new.compress.track_anchor(list(new.params.values()))
        new.step = st.step
        out[p] = new
    return out


def run_method(name: str, comp, spec, cfg: TrainConfig, plan: Plan, corpus, steps: int, windows,
               points: int, every: int, start: dict | None = None, progress_every: int = 0,
               last: int = 50) -> dict:
    """One run: its training losses, bytes per step per axis, and the held-out loss of the
    synchronised model at each of its last `points` synchronised steps; with `progress_every`,
    also at the first synchronised step from each multiple of it on (printed as it goes)."""
    losses, per_axis, evals, progress = [], dict.fromkeys(AXES, 0), [], []
    t0 = time.perf_counter()
    first = 0 if start is None else next(iter(start.values())).step
    at = set(eval_points(comp, steps, first, points, every))
    states = None if start is None else states_from(start, spec, cfg, comp)
    with LocalCluster(spec, cfg, plan, corpus, states=states, compression=comp) as cl:
        for _ in range(steps):
            losses.append(cl.step())
            n = cl.step_index
            due = progress_every and n >= (len(progress) + 1) * progress_every and \
                (comp.dp_method != "diloco" or comp.sync_due(n - 1))
            if n in at or due:
                params, same = synchronised_model(cl)
                e = {"step": n, "heldout_loss": heldout_loss(spec, params, windows), "replicas_identical": same}
                if n in at:
                    evals.append(e)
                if due:
                    progress.append(e | {"train_last": statistics.fmean(losses[-last:])})
                    print(f"    seed {cfg.seed} {name} step {n}: held-out {e['heldout_loss']:.4f}, training loss of "
                          f"the last {last} {progress[-1]['train_last']:.4f}", file=sys.stderr, flush=True)
        for a, b in cl.bytes_sent.items():
            per_axis[a] = b
    wall = time.perf_counter() - t0
    return {"name": name, "config": comp.describe(), "seed": cfg.seed, "first_step": first, "losses": losses,
            "evals": evals, "progress": progress, "heldout_loss": statistics.fmean(e["heldout_loss"] for e in evals), "wall_s": wall,
            "bytes_per_step": {a: b / steps for a, b in per_axis.items()}}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def spread(values: list[float]) -> dict:
    """Mean, min, max and sample standard deviation (0 for one value) of `values`."""
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def summarise(runs: list[dict], last: int) -> list[dict]:
    """Per method over its seeds: held-out loss of the synchronised model and training loss of
    the last `last` steps (mean, min-max, stdev), each mean's gap to exact's mean, the gaps
    paired by seed (method and exact on the same seed, same batches), bytes and ratios."""
    names = list(dict.fromkeys(r["name"] for r in runs))
    by = {n: [r for r in runs if r["name"] == n] for n in names}
    exact = by["exact"]
    ex_b = {a: statistics.fmean(r["bytes_per_step"][a] for r in exact) for a in AXES}
    ex_held = {r["seed"]: r["heldout_loss"] for r in exact}
    ex_train = {r["seed"]: statistics.fmean(r["losses"][-last:]) for r in exact}
    ex_h, ex_t = statistics.fmean(ex_held.values()), statistics.fmean(ex_train.values())
    out = []
    for n in names:
        rs = by[n]
        b = {a: statistics.fmean(r["bytes_per_step"][a] for r in rs) for a in AXES}
        held = spread([r["heldout_loss"] for r in rs])
        train = spread([statistics.fmean(r["losses"][-last:]) for r in rs])
        paired_h = [r["heldout_loss"] / ex_held[r["seed"]] - 1 for r in rs if r["seed"] in ex_held]
        paired_t = [statistics.fmean(r["losses"][-last:]) / ex_train[r["seed"]] - 1 for r in rs if r["seed"] in ex_train]
        pp, ex_pp = b["pp_fwd"] + b["pp_bwd"], ex_b["pp_fwd"] + ex_b["pp_bwd"]
        out.append({
            "name": n, "config": rs[0]["config"], "seeds": [r["seed"] for r in rs],
            "heldout": _rounded(held), "heldout_gap": round(held["mean"] / ex_h - 1, 5),
            "heldout_gap_paired": _rounded(spread(paired_h)) if paired_h else None,
            "train_last": _rounded(train), "train_gap": round(train["mean"] / ex_t - 1, 5),
            "train_gap_paired": _rounded(spread(paired_t)) if paired_t else None,
            "loss_gap": round(held["mean"] / ex_h - 1, 5),
            "replicas_identical": all(e["replicas_identical"] for r in rs for e in r["evals"]),
            "eval_steps": sorted({e["step"] for r in rs for e in r["evals"]}),
            "bytes_per_step": {a: round(v) for a, v in b.items()},
            "pp_fwd_ratio": _round(_ratio(ex_b["pp_fwd"], b["pp_fwd"])),
            "pp_bwd_ratio": _round(_ratio(ex_b["pp_bwd"], b["pp_bwd"])),
            "pp_bytes_ratio": _round(_ratio(ex_pp, pp)),
            "dp_bytes_ratio": _round(_ratio(ex_b["dp"], b["dp"])),
            "total_bytes_ratio": _round(_ratio(sum(ex_b.values()), sum(b.values()))),
            "wall_s": round(sum(r["wall_s"] for r in rs), 1),
            "speedup_measured": None, "prediction_error": None, "bandwidth_scale": None,
        })
    return out


def _rounded(d: dict) -> dict:
    return {k: (v if k == "n" else round(v, 5)) for k, v in d.items()}


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
        xs = range(r["first_step"], r["first_step"] + len(r["losses"]))
        k = 10  # running mean over 10 steps, the raw curves are noisy
        ys = [statistics.fmean(r["losses"][max(0, i - k + 1):i + 1]) for i in range(len(r["losses"]))]
        ax.plot(xs, ys, label=f"{r['name']} seed {r['seed']}", lw=1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (running mean of 10 steps)")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
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
    plan = Plan.grid(spec.n_layer, args.stages, args.dp)
    corpus, held = split_corpus()
    windows = heldout_windows(held, args.heldout_windows, spec.seq_len)
    seeds = [int(x) for x in args.seeds.split(",") if x]
    mode = f"fine-tune from {args.finetune_from_steps} exact steps, " if args.finetune_from_steps else ""
    print(f"{spec.name} {args.stages} stages x {args.dp} pipelines, batch {args.batch}, M {args.micro_batches}, "
          f"{mode}{args.steps} steps, seeds {seeds}, corpus {corpus.name} (held out: {len(windows[0])} windows "
          f"of its last {HELDOUT_BYTES} bytes)", file=sys.stderr)
    for name in names:
        if not eval_points(configs[name], args.steps, args.finetune_from_steps, args.eval_points, args.eval_every):
            raise SystemExit(f"{name} does not synchronise in steps {args.finetune_from_steps} to "
                             f"{args.finetune_from_steps + args.steps - 1}: no step to judge its model at; run more steps")
    runs: list[dict] = []
    for seed in seeds:
        cfg = TrainConfig(global_batch_seqs=args.batch, micro_batches=args.micro_batches, lr=args.lr, seed=seed)
        start = exact_start(spec, cfg, plan, corpus, args.finetune_from_steps) if args.finetune_from_steps else None
        for name in names:
            r = run_method(name, configs[name], spec, cfg, plan, corpus, args.steps, windows, args.eval_points,
                           args.eval_every, start, args.progress_every, args.last)
            runs.append(r)
            print(f"  seed {seed} {name:<10} held-out {r['heldout_loss']:.4f} at steps "
                  f"{[e['step'] for e in r['evals']]}, training loss of the last {args.last}: "
                  f"{statistics.fmean(r['losses'][-args.last:]):.4f} ({r['wall_s']:.0f} s)", file=sys.stderr)
            write_json(out / "results.json", {"args": vars(args), "runs": runs})  # as it goes: a cut run keeps its figures
    if args.no_exact:
        print(f"runs in {out / 'results.json'}: summarise them with exact's (--from-results)", file=sys.stderr)
        return []
    return report(runs, args, out)


def report(runs: list[dict], args, out: Path) -> list[dict]:
    """The table of `runs` (over their seeds), the loss plot and results.json; the summary rows."""
    summary = summarise(runs, args.last)
    pm = "\u00b1"
    print_table(["method", "config", "held-out (mean, min-max)", f"{pm} stdev", "gap", "paired gaps",
                 f"train (last {args.last})", "gap", "DP B/step", "PP ratio", "DP ratio", "total ratio", "wall s"],
                ([s["name"], s["config"],
                  f"{s['heldout']['mean']:.4f} ({s['heldout']['min']:.4f}-{s['heldout']['max']:.4f})",
                  f"{s['heldout']['stdev']:.4f}", f"{100 * s['heldout_gap']:+.2f} %",
                  _gaps(s["heldout_gap_paired"]),
                  f"{s['train_last']['mean']:.4f} ({s['train_last']['min']:.4f}-{s['train_last']['max']:.4f})",
                  f"{100 * s['train_gap']:+.2f} %", f"{s['bytes_per_step']['dp']:,}", s["pp_bytes_ratio"],
                  s["dp_bytes_ratio"], s["total_bytes_ratio"], s["wall_s"]] for s in summary))
    print(plot(runs, out / "loss.png"), file=sys.stderr)
    write_json(out / "results.json", {"args": vars(args), "summary": summary, "runs": runs})
    return summary


def _gaps(p: dict | None) -> str:
    if p is None:
        return "-"
    return f"{100 * p['min']:+.2f} to {100 * p['max']:+.2f} %"


def merge_swarm(summary: list[dict], swarm: dict | None, names: list[str], configs: dict) -> list[dict]:
    """Part 1-2 rows (or bare rows when those parts did not run) with part 3's figures per method."""
    rows = {s["name"]: dict(s) for s in summary}
    for n in names:
        if n in rows:
            continue
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
    ap.add_argument("--last", type=int, default=50, help="steps the final mean training loss is taken over")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds: every method runs on each")
    ap.add_argument("--finetune-from-steps", type=int, default=0, metavar="K",
                    help="train exact K steps (per seed), then run each method --steps more from that state")
    ap.add_argument("--from-results", default="", metavar="FILE,...",
                    help="train nothing: summarise the runs of these results.json files (e.g. one per seed) together")
    ap.add_argument("--no-exact", action="store_true",
                    help="run only --methods (exact's runs made apart, e.g. in another process; --from-results "
                         "summarises them together)")
    ap.add_argument("--progress-every", type=int, default=0, metavar="N",
                    help="also judge each run at its first synchronised step from every N steps on, printed as it goes")
    ap.add_argument("--heldout-windows", type=int, default=128,
                    help="fixed windows of the held-out text (the corpus's last MiB) the loss is judged on")
    ap.add_argument("--eval-points", type=int, default=4,
                    help="the held-out loss is the mean over the run's last this many synchronised steps")
    ap.add_argument("--eval-every", type=int, default=16,
                    help="steps between evaluation points of a run synchronised at every step (exact, pp-*, cocktail)")
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
    if args.steps < 1 or args.finetune_from_steps < 0 or args.eval_points < 1 or args.eval_every < 1:
        ap.error("--steps, --eval-points and --eval-every must be positive, --finetune-from-steps not negative")
    try:
        if not [int(x) for x in args.seeds.split(",") if x]:
            raise ValueError
    except ValueError:
        ap.error("--seeds takes comma-separated integers, e.g. 0,1,2")
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
    if "exact" not in names and not args.no_exact:
        names.insert(0, "exact")
        configs["exact"] = get_compression("exact")
    if args.no_exact and args.recommended not in names:
        args.recommended = names[0]
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
    if args.from_results:  # runs made apart (e.g. one process per seed), summarised together
        runs = [r for f in args.from_results.split(",") if f for r in json.loads(Path(f).read_text())["runs"]]
        summary = report(runs, args, out)
        names = list(dict.fromkeys(r["name"] for r in runs))
    else:
        summary = part12(args, names, configs, out) if parts & {"1", "2"} else []
    if args.from_results:
        parts = {"1", "2"}
    swarm = part3(args, out) if "3" in parts else None
    rows = merge_swarm(summary, swarm, names if summary else [args.recommended], configs)
    rec = next(s for s in rows if s["name"] == args.recommended)
    top = {k: rec.get(k) for k in ("pp_bytes_ratio", "dp_bytes_ratio", "total_bytes_ratio", "loss_gap",
                                    "heldout_gap", "train_gap", "speedup_measured", "prediction_error",
                                    "bandwidth_scale")}
    goals = {"pp_ratio_goal": PP_GOAL, "dp_ratio_goal": DP_GOAL, "loss_gap_goal": LOSS_GOAL,
             "speedup_goal": SPEEDUP_GOAL, "prediction_error_goal": PREDICTION_GOAL}
    missing = [f"parts {p}" for p, ran in (("1-2", bool(summary)), ("3", swarm is not None)) if not ran]
    extra = {"note": f"not run: {', '.join(missing)} (their keys are null)"} if missing else {}
    if swarm is not None:
        extra["swarm_shape"] = swarm["shape"]
    if args.from_results:  # what the runs were, not this command's defaults
        extra |= {"seeds": ",".join(str(x) for x in sorted({r["seed"] for r in runs})),
                  "steps": max(len(r["losses"]) for r in runs),
                  "finetune_from_steps": max(r["first_step"] for r in runs)}
    elif summary:
        extra |= {"seeds": args.seeds, "steps": args.steps, "finetune_from_steps": args.finetune_from_steps}
    print(json.dumps({"recommended": args.recommended, "parts": sorted(parts), **top, **goals, **extra,
                      "methods": [{k: v for k, v in s.items() if k != "config"} | {"config": s.get("config")}
                                  for s in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
