"""dtfm-sched: schedule a scenario, or compare the search with baselines.

    dtfm-sched solve --scenario worldwide --model gpt3-xl-paper --stages 8 --dp 8 --json
    dtfm-sched compare --scenario worldwide --model gpt3-xl-paper --time-budget 20
    dtfm-sched solve --scenario worldwide --compress auto --codec-speed reference
    dtfm-sched solve --scenario worldwide --peers 8 --model gpt-tiny --stages auto --micro-batches auto

Exit status (dtfm.cli_base): 0 success, 1 an error explained on stderr (`dtfm-sched: error:
...`), 2 bad command line, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from dtfm.cli_base import NON_NEGATIVE_INT, POSITIVE_INT, CliError, number, run_command, version_text
from dtfm.scenarios import ScenarioError, load_scenario

from .choose import ChoiceReason, CompressionPlan, choose_compression
from .compression import WIRE_PRESETS, CompressionOptions, compression_options, load_codec_speed
from .construct import consecutive, dp_aligned, locality_order, pp_aligned, random_allocation
from .cost import CostModel
from .fastest import FastestShape, ScheduleInputs, micro_batch_options
from .search import SearchConfig, ShapeSearch
from .simulate import TRAINER_WINDOW_MESSAGES, fitted_warmups, simulate
from .solve import candidate_shapes, cost_model, solve
from .spec import PRESETS, ModelSpec, get_preset

__all__ = ["main"]

PROG = "dtfm-sched"


def _stages(text: str) -> int | str:
    return "auto" if text == "auto" else number(int, 1, "a positive integer or 'auto'")(text)


def _micro_batches(text: str) -> int | str:
    return "auto" if text == "auto" else number(int, 1, "a positive integer or 'auto'")(text)


def _fraction(text: str) -> float:
    value = number(float, 0.0, "a fraction in [0, 1)")(text)
    if not value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    defaults = SearchConfig()
    p = argparse.ArgumentParser(prog=PROG, description="DT-FM allocation scheduler",
                                epilog="Exit status: 0 success, 1 an error explained on stderr, "
                                       "2 bad command line.")
    p.add_argument("--version", action="version", version=version_text())
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("solve", "search an allocation"), ("compare", "the search against baselines")):
        c = sub.add_parser(name, help=text)
        where = c.add_mutually_exclusive_group(required=True)
        where.add_argument("--scenario", help="built-in scenario name or TOML file")
        if name == "solve":
            where.add_argument("--view", type=Path, metavar="FILE.json",
                               help="a swarm coordinator's inputs for a first placement (DATA_DIR/schedules/"
                                    "schedule-*.json): the same search on the same measured view, compute "
                                    "figures and model; prints the shape it chooses, why, and the "
                                    "coordinator's choice")
        c.add_argument("--model", default="gpt3-xl-paper", choices=sorted(PRESETS), help="model preset")
        c.add_argument("--stages", type=_stages, default=None,
                       help="pipeline stages, or 'auto' (default: the preset's)")
        c.add_argument("--dp", type=POSITIVE_INT, default=None, help="pipelines (default: peers // stages)")
        c.add_argument("--seed", type=int, default=0)
        c.add_argument("--time-budget", type=number(float, 1e-9, "a positive number"),
                       default=defaults.time_budget_s, help="seconds of search")
        c.add_argument("--generations", type=NON_NEGATIVE_INT, default=None,
                       help="cap evolution rounds (repeatable runs)")
        c.add_argument("--no-spares", action="store_true", help="every peer must take part")
        c.add_argument("--uneven-layers", action="store_true", help="let faster stages hold more layers")
        c.add_argument("--peers", type=POSITIVE_INT, default=None, help="scale the scenario to this many peers")
        c.add_argument("--compress", default="exact", metavar="auto|exact|NAME[,NAME...]",
                       help="codecs the scheduler may use per pipeline link and DP group: auto (every "
                            f"preset's), exact (none), or presets from {', '.join(WIRE_PRESETS)}; "
                            "exact links stay possible (default: %(default)s)")
        c.add_argument("--codec-speed", default="reference", metavar="reference|free|FILE.json",
                       help="what coding costs on a peer's CPU: the development machine's measured "
                            "figure, free (an upper bound of what compression saves), or a JSON file of "
                            "dtfm.train.compress.measure_compress_cost() (default: %(default)s)")
        c.add_argument("--min-saving", type=_fraction, default=0.0, metavar="FRACTION",
                       help="with --compress: compress a link or group only where that saves at least "
                            "this fraction of the exact iteration (default: %(default)s, any saving)")
        c.add_argument("--json", action="store_true", help="print JSON")
        c.add_argument("--plot", default=None, metavar="FILE.png", help="draw the allocation (matplotlib)")
        if name == "solve":
            c.add_argument("--micro-batches", type=_micro_batches, default=None, metavar="N|auto",
                           help="micro-batches per pipeline, with a model preset that has a batch (gpt3-xl, "
                                "gpt-tiny): the allocation simulated at N, or at every count that divides the "
                                "per-pipeline batch (at most 64) and the fastest kept (auto), each with its "
                                "micro-batch's size and the trainer's flow-control window (default: the "
                                "preset's micro-batch size)")
        if name == "compare":
            c.add_argument("--random-samples", type=POSITIVE_INT, default=5000,
                           help="random allocations to sample")
    return p


def _compression(args) -> CompressionOptions | None:
    """The --compress and --codec-speed options; None for exact."""
    names = [n.strip() for n in args.compress.split(",") if n.strip()]
    if not names:
        raise CliError("--compress: name auto, exact or presets")
    try:
        speed = load_codec_speed(args.codec_speed)
    except OSError as e:
        raise CliError(f"--codec-speed: cannot read {args.codec_speed}: {e.strerror}") from None
    except ValueError as e:
        raise CliError(f"--codec-speed: {args.codec_speed} is not a codec speed JSON object: {e}") from None
    try:
        opts = compression_options(names, speed)
    except ValueError as e:
        raise CliError(f"--compress: {e}") from None
    return None if opts.exact else opts


def _inputs(args):
    sc = load_scenario(args.scenario)
    if args.peers:
        sc = sc.scaled(args.peers)
    spec = get_preset(args.model)
    memory = None
    if all(r.memory_gib is not None for r in sc.regions):
        memory = np.array([r.memory_gib for r in sc.regions for _ in range(r.peers)])
    _check_shape(args, sc, spec, memory)
    return sc, spec, sc.compute_scale(), memory, args.stages


def _check_shape(args, sc, spec, memory) -> None:
    """CliError, naming the flags, when the shape asked for cannot be built from the scenario's
    peers (`solve` refuses the same with a ValueError, for callers of the API)."""
    n, stages, dp = sc.n_peers, args.stages, args.dp
    if stages is None:  # the preset's shape where the scenario has the peers for it, else auto
        S0, D0 = getattr(spec, "default_stages", 0), getattr(spec, "default_dp", 0)
        stages, dp = (S0, dp or D0) if 0 < S0 * D0 <= n else ("auto", dp)
    if stages == "auto":
        shapes = candidate_shapes(n, spec, allow_spares=not args.no_spares, uneven_layers=args.uneven_layers,
                                  memory_gib=memory)
        if not any(dp is None or D == dp for _, D in shapes):
            with_dp = "" if dp is None else f" as {dp} pipelines"
            raise CliError(f"no shape of the {n} peers of {sc.name}{with_dp} fits model {spec.name} "
                           f"({spec.layers} layers): change --peers, --dp or --model")
        return
    if stages > spec.layers:
        raise CliError(f"--stages {stages}: model {spec.name} has only {spec.layers} layers")
    if stages > n:
        raise CliError(f"--stages {stages} needs at least {stages} peers, {sc.name} has {n}: raise --peers")
    dp = dp or n // stages
    if stages * dp > n:
        raise CliError(f"{stages} stages x {dp} pipelines needs {stages * dp} peers, {sc.name} has {n}: "
                       f"raise --peers or shrink --stages/--dp")
    if stages * dp < n and args.no_spares:
        raise CliError(f"--no-spares: the {n} peers of {sc.name} do not form {stages} x {dp}")


def _replay_schedule(inputs: ScheduleInputs, found: FastestShape) -> tuple[tuple[int, ...] | None, float]:
    """The pipeline schedule the coordinator fits to the replayed allocation (`fitted_warmups`,
    with the trainer's syncs and window, each link at its cheapest allowed codec), and its
    simulated iteration; None where GPipe is as fast (then GPipe's)."""
    alloc = found.alloc
    S, D = alloc.stages, alloc.dp
    M = found.micro_batches or inputs.model.micro_batches
    model = CostModel(inputs.delay_ms, inputs.bandwidth_gbps, inputs.spec_of(D, M).workload(S, D),
                      compute=inputs.speeds if inputs.reference_tflops is not None else None,
                      compression=inputs.compression)
    fit = fitted_warmups(model, alloc.matrix, M, inputs.window_messages)
    return fit.warmups, fit.iteration_s


def _replay(args) -> int:
    """`solve --view FILE`: the coordinator's shape search on its own inputs."""
    try:
        inputs = ScheduleInputs.read(args.view)
    except OSError as e:
        raise CliError(f"--view: cannot read {args.view}: {e.strerror}") from None
    except ValueError as e:
        raise CliError(f"--view: {e}") from None
    found = inputs.solve(None if args.time_budget == SearchConfig().time_budget_s else args.time_budget)
    n = len(inputs.peers)
    alloc = found.alloc
    # (a search that ranked shapes under their fitted schedules names the winner's; else fit it now)
    warmups, scheduled_s = (found.warmups, found.scheduled_s) if found.scheduled else _replay_schedule(inputs, found)
    out = {"view": str(args.view), "model": inputs.model.name, **alloc.to_dict(),
           "simulated_iteration_s": found.iteration_s, "micro_batches": found.micro_batches, "note": found.note(n),
           "tried": [{"stages": s, "dp": d, "simulated_iteration_s": t} for s, d, t in found.tried],
           "pipeline_warmups": None if warmups is None else list(warmups), "scheduled_iteration_s": scheduled_s,
           "coordinator": dict(inputs.chosen)}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.view}: {n} peers, model {inputs.model.name}")
    print(f"shape: {found.note(n)}")
    if warmups is not None:
        print(f"pipeline schedule: 1F1B with warm-ups {','.join(map(str, warmups))}: {scheduled_s:.3f} s/step "
              f"with the trainer's syncs and window, against {found.iteration_s:.3f} s in GPipe")
    regions = inputs.regions
    for p, pipe in enumerate(alloc.pipelines):
        print(f"pipeline {p}: " + " -> ".join(f"{i}({regions[i]})" for i in pipe))
    if alloc.spares:
        print("spares: " + ", ".join(f"{i}({regions[i]})" for i in alloc.spares))
    if inputs.chosen:
        print(f"the coordinator chose: {inputs.chosen.get('note', '')}")
    return 0


def _solve(args) -> int:
    if args.view is not None:
        return _replay(args)
    plot = _plotter(args.plot)
    sc, spec, compute, memory, stages = _inputs(args)
    opts = _compression(args)
    _check_micro_args(args, spec)  # (before the search: a wrong flag costs no minutes)
    alloc = solve(sc.delay_ms(), sc.bandwidth_gbps(), spec, stages=stages, dp=args.dp, compute=compute,
                  memory_gib=memory, regions=sc.peer_regions(), seed=args.seed, time_budget_s=args.time_budget,
                  generations=args.generations, allow_spares=not args.no_spares, uneven_layers=args.uneven_layers,
                  compression=opts)
    model = cost_model(sc.delay_ms(), sc.bandwidth_gbps(), spec, alloc.stages, alloc.dp, compute=compute,
                       memory_gib=memory, uneven_layers=args.uneven_layers, compression=opts)
    plan = choose_compression(model, alloc.matrix, min_saving_fraction=args.min_saving) if opts is not None else None
    sim_s = plan.iteration_s if plan is not None else simulate(model, alloc.matrix).iteration_s
    out = {"scenario": sc.name, "model": spec.name, **alloc.to_dict(), "simulated_iteration_s": sim_s}
    micro = _micro_times(args, sc, spec, compute, memory, alloc)
    if micro:
        sim_s = min(micro.values())
        out["micro_batches"] = min(micro, key=micro.__getitem__)
        out["micro_batches_tried"] = [{"micro_batches": m, "simulated_iteration_s": t} for m, t in micro.items()]
        out["simulated_iteration_s"] = sim_s
    if plan is not None:
        out["compression"] = plan.to_dict()
    warmups, scheduled_s = None, sim_s
    if not micro and alloc.stages > 1:  # (the order of each stage's forwards and backwards: sched/simulate.py)
        fit = fitted_warmups(model, alloc.matrix, codecs=plan.assignment if plan is not None else None,
                             engine_syncs=False)
        if fit.warmups is not None:
            warmups, scheduled_s = fit.warmups, fit.iteration_s
        out["pipeline_warmups"] = None if warmups is None else list(warmups)
        out["scheduled_iteration_s"] = scheduled_s
    if args.json:
        print(json.dumps(out))
    else:
        c = alloc.cost
        print(f"{sc.name}: {alloc.stages} stages x {alloc.dp} pipelines, {len(alloc.spares)} spares")
        what = "cost with each link's and group's cheapest codec" if plan is not None else "cost"
        print(f"{what} {c.paper_s:.4f} s (DP {c.dp_s:.4f} + 2 x PP {c.pp_s:.4f}); objective {c.total_s:.4f} s; "
              f"simulated iteration {sim_s:.4f} s; searched {alloc.elapsed_s:.1f} s")
        if warmups is not None:
            print(f"pipeline schedule: 1F1B with warm-ups {','.join(map(str, warmups))}: simulated iteration "
                  f"{scheduled_s:.4f} s against {sim_s:.4f} s in GPipe")
        if micro:
            best = min(micro, key=micro.__getitem__)
            rest = ", ".join(f"{m}: {t:.4f} s" for m, t in micro.items() if m != best)
            print(f"micro-batches: {best} ({micro[best]:.4f} s)" + (f"; {rest}" if rest else ""))
        regions = sc.peer_regions()
        for p, pipe in enumerate(alloc.pipelines):
            print(f"pipeline {p}: " + " -> ".join(f"{i}({regions[i]})" for i in pipe))
        if alloc.spares:
            print("spares: " + ", ".join(f"{i}({regions[i]})" for i in alloc.spares))
        if plan is not None:
            print("\n".join(plan_lines(plan, regions)))
    if plot:
        plot(args.plot, sc.delay_ms(), sc.peer_regions(), alloc.matrix, alloc.spares, plot_title(sc.name, alloc))
    return 0


def _check_micro_args(args, spec) -> None:
    """CliError where `solve --micro-batches` cannot apply: a model of fixed volumes, or a
    flag it does not combine with."""
    if args.micro_batches is None:
        return
    if not isinstance(spec, ModelSpec):
        raise CliError(f"--micro-batches: model {spec.name} has no batch (its volumes are fixed): choose "
                       "gpt3-xl or gpt-tiny")
    if args.compress != "exact" or args.uneven_layers:
        raise CliError("--micro-batches takes neither --compress nor --uneven-layers")


def _micro_times(args, sc, spec, compute, memory, alloc) -> dict[int, float]:
    """`solve --micro-batches`: the allocation's simulated iteration at each micro-batch count
    (N, or every count of `micro_batch_options` for its D), the model's micro-batch size
    following from its fixed global batch, with the trainer's flow-control window; {} without
    the flag."""
    if args.micro_batches is None:
        return {}
    D = alloc.dp  # (the flags were checked before the search: `_check_micro_args`)
    counts = (micro_batch_options(spec.global_batch_seqs, D) if args.micro_batches == "auto"
              else (int(args.micro_batches),))
    if not counts or D * counts[0] > spec.global_batch_seqs:
        raise CliError(f"--micro-batches {args.micro_batches}: {D} pipelines of a global batch of "
                       f"{spec.global_batch_seqs} sequences cannot run it")
    out = {}
    for m in counts:
        at = replace(spec, micro_batch_size=max(1, spec.global_batch_seqs // (D * m)))
        model = cost_model(sc.delay_ms(), sc.bandwidth_gbps(), at, alloc.stages, D, compute=compute, memory_gib=memory)
        out[m] = float(simulate(model, alloc.matrix, micro_batches=m, window_messages=TRAINER_WINDOW_MESSAGES).iteration_s)
    return out


def plan_lines(plan: CompressionPlan, regions) -> list[str]:
    """The compression plan as text: every compressed link and group with what it saves, and
    why the others stay exact."""
    lines = [f"compression: predicted iteration {plan.iteration_s:.4f} s (exact {plan.exact_iteration_s:.4f} s; "
             f"best single setting {plan.best_global[0]} / {plan.best_global[1]}: "
             f"{plan.best_global_iteration_s:.4f} s)"]
    for g in plan.groups:
        if g.codec.exact:
            continue
        lines.append(f"  DP group of stage {g.stage}: {g.codec.name}, one sync {g.sync_s:.3f} s every "
                     f"{g.sync_every} steps (exact {g.exact_sync_s:.3f} s every step); saves {g.saving_s:.3f} s "
                     f"per iteration ({g.reason.value})")
    for c in plan.links:
        if c.codec.exact:
            continue
        lines.append(f"  link {c.stage}->{c.stage + 1} of pipeline {c.pipeline}, {c.src}({regions[c.src]}) -> "
                     f"{c.dst}({regions[c.dst]}): {c.codec.name}, {c.link_s:.4f} s per micro-batch (exact "
                     f"{c.exact_link_s:.4f} s, compute it overlaps {c.overlap_compute_s:.4f} s); saves "
                     f"{c.saving_s:.3f} s ({c.reason.value})")
    for what, items in (("links", plan.links), ("DP groups", plan.groups)):
        counts: dict[ChoiceReason, int] = {}
        for item in items:
            if item.codec.exact:
                counts[item.reason] = counts.get(item.reason, 0) + 1
        if counts:
            lines.append(f"  exact {what}: " + ", ".join(f"{k} {r.value}" for r, k in counts.items()))
    return lines


def _compare(args) -> int:
    plot = _plotter(args.plot)
    sc, spec, compute, memory, stages = _inputs(args)
    opts = _compression(args)
    dl, bw = sc.delay_ms(), sc.bandwidth_gbps()
    t0 = time.perf_counter()
    alloc = solve(dl, bw, spec, stages=stages, dp=args.dp, compute=compute, memory_gib=memory,
                  regions=sc.peer_regions(), seed=args.seed, time_budget_s=args.time_budget,
                  generations=args.generations, allow_spares=not args.no_spares, uneven_layers=args.uneven_layers,
                  compression=opts)
    search_s = time.perf_counter() - t0
    S, D, n = alloc.stages, alloc.dp, sc.n_peers
    model = cost_model(dl, bw, spec, S, D, compute=compute, memory_gib=memory, uneven_layers=args.uneven_layers,
                       compression=opts)
    order = locality_order(model.hop, sc.peer_regions())
    matcher = ShapeSearch(model, S, D, SearchConfig(), args.seed, float("inf"))
    rows = {"search": alloc.matrix}
    rng = np.random.default_rng(args.seed)
    best_rand, best_cost = None, np.inf
    for _ in range(args.random_samples):
        X, _ = random_allocation(n, S, D, rng)
        c = model.total(X)
        if c < best_cost:
            best_rand, best_cost = X, c
    if best_rand is not None:  # (no row with --random-samples 0)
        rows[f"random (best of {args.random_samples})"] = best_rand
    rows["region per DP group"] = matcher.realize(dp_aligned(order, S, D)[0])
    rows["region per pipeline"] = pp_aligned(order, S, D)[0]
    rows["homogeneous (consecutive)"] = consecutive(n, S, D)[0]
    table = []
    for name, X in rows.items():
        bd = model.breakdown(X)
        table.append({"method": name, "cost_s": bd.paper_s, "dp_s": bd.dp_s, "pp_s": bd.pp_s,
                      "objective_s": bd.total_s, "simulated_s": simulate(model, X).iteration_s})
    out = {"scenario": sc.name, "model": spec.name, "stages": S, "dp": D, "search_s": search_s, "rows": table}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{sc.name}: {S} stages x {D} pipelines, model {spec.name}, search {search_s:.1f} s")
        print(f"{'method':32s} {'cost s':>10s} {'DP s':>9s} {'PP s':>9s} {'simulated s':>12s}")
        for r in table:
            print(f"{r['method']:32s} {r['cost_s']:10.3f} {r['dp_s']:9.3f} {r['pp_s']:9.3f} {r['simulated_s']:12.3f}")
    if plot:
        plot(args.plot, sc.delay_ms(), sc.peer_regions(), alloc.matrix, alloc.spares,
             plot_title(sc.name, alloc, "search: "))
    return 0


def plot_title(scenario: str, alloc, what: str = "") -> str:
    """The allocation plot's title: the shape, and which cost the number is."""
    c = alloc.cost
    return (f"{scenario}: {what}{alloc.stages} stages x {alloc.dp} pipelines\n"
            f"communication cost per iteration (DT-FM's): {c.paper_s:.2f} s\n"
            f"= data-parallel {c.dp_s:.2f} s + 2 x pipeline {c.pp_s:.2f} s")


def _plotter(path: str | None):
    """plot_allocation when --plot is given, checked before the search runs."""
    if path is None:
        return None
    try:
        from .plot import plot_allocation  # matplotlib: only --plot loads it
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != "matplotlib":
            raise
        raise CliError("--plot needs matplotlib, part of dtfm's install: reinstall dtfm "
                       "(pip install -e .) in this environment") from None
    return plot_allocation


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_command(PROG, lambda: _solve(args) if args.command == "solve" else _compare(args),
                       user_errors=(ScenarioError,))


if __name__ == "__main__":
    sys.exit(main())
