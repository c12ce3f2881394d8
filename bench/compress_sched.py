"""The scheduler that knows compression, on the paper's worldwide network (issue 19, part 4,
and the bandwidth scale of part 3). Every figure here is SIMULATED: predicted by dtfm.sched's
cost model and GPipe iteration simulator, no daemon runs.

Part 4: for each model, the allocation the search finds without compression (the paper's
objective) and the one it finds knowing the compression (each link and DP group costed with
its cheapest allowed codec); both then compressed by `choose_compression` (a codec per link
and group, by the simulator) and their predicted iteration times compared. Coding costs what
`measure_compress_cost()` measures on this CPU (one thread), and, as the bound a GPU codec
approaches, nothing.

Part 3's scale: the share of an iteration the paper's GPT-3 XL spends communicating on its
worldwide network, with the cost model: comm = DPcost + 2 PPcost of the searched 8 x 8
allocation (the paper's volumes), compute = the GPipe compute term (M + S - 1) x a stage's
time per micro-batch of GPT-3 XL from its hyper-parameters (`gpt3-xl`: 1M-token batches,
micro-batches of one sequence, 40 TFLOP/s achieved per GPU); share = comm / (comm + compute).
Then the `--bandwidth-scale` at which exact `tiny` on the emulated worldwide swarm (8 peers,
the shape the swarm's scheduler picks, global batch 16, 4 micro-batches, fp32 activations)
has the same share, its compute per iteration taken as `--tiny-compute-s` (the issue's 0.15 s,
measured on the emulated swarm). That share counts no overlap; bench/compress_swarm.py no
longer uses this scale: it computes the one at which exact `tiny` is as bandwidth-bound as
GPT-3 XL by the simulator (about 0.011).

    nice .venv/bin/python bench/compress_sched.py [--time-budget 10] [--codec-speed measure|reference|free|FILE]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace

import numpy as np

from dtfm.scenarios import load_scenario
from dtfm.sched import (PAPER_GPT3_XL, PRESETS, REFERENCE_CODEC_SPEED, CodecSpeed, ModelSpec, choose_compression,
                        compression_options, cost_model, simulate_iteration, solve)

from common import print_table

NOTE = ("SIMULATED figures: predicted by dtfm.sched's cost model and iteration simulator on the scenario's "
        "matrices; no daemon ran")


def codec_speed(arg: str) -> tuple[CodecSpeed, str]:
    if arg == "measure":
        import torch

        from dtfm.train.compress import measure_compress_cost
        torch.set_num_threads(1)
        return measure_compress_cost(), "measured on this CPU, one thread"
    if arg == "reference":
        return REFERENCE_CODEC_SPEED, "the development machine's reference figure"
    if arg == "free":
        return CodecSpeed(), "free"
    with open(arg, encoding="utf-8") as f:
        return CodecSpeed.from_dict(json.load(f)), f"from {arg}"


def part4(name: str, spec, dl, bw, regions, S: int, D: int, speeds: dict[str, CodecSpeed], args,
          *, micro_batches: int | None = None) -> list[dict]:
    rows = []
    t0 = time.perf_counter()
    exact_alloc = solve(dl, bw, spec, stages=S, dp=D, regions=regions, seed=args.seed,
                        time_budget_s=args.time_budget, generations=args.generations, allow_spares=False)
    exact_model = cost_model(dl, bw, spec, S, D)
    exact_s = simulate_iteration(exact_model, exact_alloc.matrix, micro_batches=micro_batches).iteration_s
    for label, speed in speeds.items():
        opts = compression_options(["auto"], speed)
        knowing = solve(dl, bw, spec, stages=S, dp=D, regions=regions, seed=args.seed, time_budget_s=args.time_budget,
                        generations=args.generations, allow_spares=False, compression=opts)
        model = cost_model(dl, bw, spec, S, D, compression=opts)
        plan0 = choose_compression(model, exact_alloc.matrix, micro_batches=micro_batches)
        plan1 = choose_compression(model, knowing.matrix, micro_batches=micro_batches)

        def counts(plan) -> dict:
            return {"links": sum(not c.codec.exact for c in plan.links), "of_links": len(plan.links),
                    "groups": sum(not g.codec.exact for g in plan.groups), "of_groups": len(plan.groups),
                    "codecs": sorted({c.codec.name for c in list(plan.links) + list(plan.groups)
                                      if not c.codec.exact})}
        rows.append({
            "model": name, "shape": f"{S}x{D}", "codec_speed": label,
            "exact_allocation_exact_s": round(exact_s, 4),
            "exact_allocation_compressed_s": round(plan0.iteration_s, 4),
            "exact_allocation_best_global_s": round(plan0.best_global_iteration_s, 4),
            "knowing_allocation_compressed_s": round(plan1.iteration_s, 4),
            "knowing_allocation_best_global_s": round(plan1.best_global_iteration_s, 4),
            "knowing_gain": round(plan0.iteration_s / plan1.iteration_s, 4),
            "compression_speedup": round(exact_s / plan1.iteration_s, 3),
            "same_allocation": sorted(map(tuple, exact_alloc.matrix.T.tolist())) == sorted(map(tuple, knowing.matrix.T.tolist())),
            "exact_allocation_compresses": counts(plan0), "knowing_allocation_compresses": counts(plan1),
            "exact_allocation": [[regions[i] for i in p] for p in exact_alloc.pipelines],
            "knowing_allocation": [[regions[i] for i in p] for p in knowing.pipelines],
        })
    print(f"  {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    for r in rows:  # the allocations (regions per pipeline) only where they differ
        if r["same_allocation"]:
            del r["exact_allocation"], r["knowing_allocation"]
    if not rows[0]["same_allocation"]:
        for what in ("exact", "knowing"):
            pipes = "; ".join(" -> ".join(p) for p in rows[0][f"{what}_allocation"])
            print(f"    {what} allocation: {pipes}", file=sys.stderr)
    return rows


def tiny_spec(dp: int, micro_batches: int, global_batch: int, layer_compute_s: float | None) -> ModelSpec:
    """train's `tiny` as the swarm's coordinator describes it (control.coordinator.sched_spec),
    with a compute time per layer and micro-batch when given."""
    from dtfm.train import get_preset

    g = get_preset("tiny")
    mb = max(1, global_batch // (dp * micro_batches))
    spec = ModelSpec(g.name, layers=g.n_layer, hidden=g.n_embd, heads=g.n_head, seq_len=g.seq_len, vocab=g.vocab,
                     micro_batch_size=mb, global_batch_seqs=global_batch, act_bytes=4)
    if layer_compute_s is None:
        return spec
    at_one = replace(spec, reference_tflops=1.0).workload(1, dp).layer_compute_s
    assert at_one is not None
    return replace(spec, reference_tflops=at_one / layer_compute_s)


def compressed_links(k: dict) -> str:
    """`6/6, 4/4 (int8/64, ...)`: the links and data-parallel groups an allocation compresses."""
    return f"{k['links']}/{k['of_links']}, {k['groups']}/{k['of_groups']} ({', '.join(k['codecs']) or 'none'})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-budget", type=float, default=10.0, help="seconds of search per allocation")
    ap.add_argument("--generations", type=int, default=20, help="cap on evolution rounds (repeatable runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--codec-speed", default="measure", help="measure | reference | free | FILE.json")
    ap.add_argument("--codec-speed-out", default=None, metavar="FILE.json",
                    help="write the codec speed used (for dtfm-sched --codec-speed)")
    ap.add_argument("--tiny-compute-s", type=float, default=0.15,
                    help="compute per iteration of exact tiny on the emulated swarm (issue 19: 0.15 s of a 1.8 s step)")
    ap.add_argument("--tiny-batch", type=int, default=16)
    ap.add_argument("--tiny-micro-batches", type=int, default=4)
    args = ap.parse_args(argv)
    speed, speed_note = codec_speed(args.codec_speed)
    if args.codec_speed_out:
        with open(args.codec_speed_out, "w", encoding="utf-8") as f:
            json.dump(speed.to_dict(), f)
    print(f"{NOTE}\ncodec speed ({speed_note}), ns per element: {json.dumps(speed.to_dict())}", file=sys.stderr)
    speeds = {"cpu": speed, "free": CodecSpeed()}

    sc = load_scenario("worldwide")
    dl, bw, regions = sc.delay_ms(), sc.bandwidth_gbps(), sc.peer_regions()

    # -- part 3's share: GPT-3 XL on the paper's worldwide network --------------------------
    paper = solve(dl, bw, PAPER_GPT3_XL, stages=8, dp=8, regions=regions, seed=args.seed,
                  time_budget_s=args.time_budget, generations=args.generations)
    comm = paper.cost.paper_s
    compute = cost_model(dl, bw, PRESETS["gpt3-xl"], 8, 8).breakdown(paper.matrix).compute_s
    share = comm / (comm + compute)
    print(f"\nGPT-3 XL on worldwide (8 x 8): communication {comm:.3f} s (DP {paper.cost.dp_s:.3f} + 2 x PP "
          f"{paper.cost.pp_s:.3f}), compute {compute:.3f} s: {100 * share:.1f} % of the iteration communicates",
          file=sys.stderr)

    # -- tiny on the emulated worldwide swarm: 8 peers, the swarm's own shape ------------------
    sc8 = sc.scaled(8)
    dl8, bw8, reg8 = sc8.delay_ms(), sc8.bandwidth_gbps(), sc8.peer_regions()
    shape = solve(dl8, bw8, tiny_spec(8, args.tiny_micro_batches, args.tiny_batch, None), stages="auto",
                  regions=reg8, seed=args.seed, time_budget_s=args.time_budget, generations=args.generations,
                  allow_spares=False)
    S8, D8 = shape.stages, shape.dp
    spec8 = tiny_spec(D8, args.tiny_micro_batches, args.tiny_batch, None)

    def tiny_comm(scale: float) -> float:
        return cost_model(dl8, bw8 * scale, spec8, S8, D8).breakdown(shape.matrix).paper_s

    def tiny_share(scale: float) -> float:
        c = tiny_comm(scale)
        return c / (c + args.tiny_compute_s)

    lo, hi = 1e-6, 1e3  # the share falls as bandwidth grows
    if tiny_share(hi) >= share:
        scale = math.inf  # latency alone is already that share
    elif tiny_share(lo) <= share:
        scale = lo
    else:
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if tiny_share(mid) > share else (lo, mid)
        scale = math.sqrt(lo * hi)
    print(f"tiny, 8 peers on worldwide as {S8} x {D8} (the swarm's scheduler's shape): communication "
          f"{tiny_comm(1.0):.4f} s at full bandwidth, {tiny_comm(0.05):.3f} s at the swarm's default scale 0.05; "
          f"with {args.tiny_compute_s} s of compute the same {100 * share:.1f} % share needs "
          f"--bandwidth-scale {scale:.4g} (communication {tiny_comm(scale):.3f} s)", file=sys.stderr)

    # -- part 4 -----------------------------------------------------------------------------
    print("\npart 4: allocation chosen without compression vs knowing it, both compressed", file=sys.stderr)
    rows = part4("gpt3-xl-paper", PAPER_GPT3_XL, dl, bw, regions, 8, 8, speeds, args)
    rows += part4("gpt3-xl (compute, 61 micro-batches)", PRESETS["gpt3-xl"], dl, bw, regions, 8, 8, speeds, args)
    layer_s = args.tiny_compute_s / ((args.tiny_micro_batches + S8 - 1) * (spec8.layers // S8))
    tiny_c = tiny_spec(D8, args.tiny_micro_batches, args.tiny_batch, layer_s)
    rows += part4(f"tiny (8 peers, bandwidth x {scale:.3g})", tiny_c, dl8, bw8 * scale, reg8, S8, D8, speeds, args,
                  micro_batches=args.tiny_micro_batches)
    print_table(["model", "shape", "coding", "exact alloc., exact s", "exact alloc., compressed s",
                 "knowing alloc., compressed s", "knowing gain", "exact / knowing compressed", "same alloc.",
                 "compressed links, groups (knowing)"],
                ([r["model"], r["shape"], r["codec_speed"], r["exact_allocation_exact_s"],
                  r["exact_allocation_compressed_s"], r["knowing_allocation_compressed_s"], r["knowing_gain"],
                  r["compression_speedup"], r["same_allocation"], compressed_links(r["knowing_allocation_compresses"])]
                 for r in rows))
    print(json.dumps({
        "simulated": True, "note": NOTE, "codec_speed": speed.to_dict(), "codec_speed_source": speed_note,
        "gpt3_xl_comm_share": round(share, 4), "gpt3_xl_comm_s": round(comm, 4), "gpt3_xl_compute_s": round(compute, 4),
        "tiny_shape": f"{S8}x{D8}", "tiny_compute_s": args.tiny_compute_s,
        "bandwidth_scale": None if math.isinf(scale) else round(scale, 5),
        "part4": rows,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
