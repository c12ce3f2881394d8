"""What the scheduler's choice of the micro-batch count buys (`--micro-batches auto`), by the
simulator: the coordinator's own shape search (`ScheduleInputs.solve`, what `choose_shape` runs
and `dtfm-sched solve --view` replays) on the worldwide scenario's 8 peers (one per city), for
the swarm's `tiny` run (global batch 16), with the run's count fixed at the default 4 and left to
the scheduler, on the paper's network and at the bandwidth scale of the compression bench
(bench/compress_swarm.py, where exact tiny is as bandwidth-bound as GPT-3 XL; computed here the
same way unless --bandwidth-scale is given).

Compute, by default, is the compression bench's figure for exact tiny on the emulated swarm's
daemons (`TINY_COMPUTE_S` of compute per iteration at 4 x 2 and 4 micro-batches, on an unloaded
2-core machine), every micro-batch size at the same time per FLOP: the choice then weighs the
GPipe bubble against the trainer's flow-control window alone. With --measure-compute it is this
machine's, as a daemon measures it: the reference block timed here (each peer at that speed) and
the tiny layer's time per FLOP at each micro-batch size (`kind_factors`); on a loaded machine
these figures are noise.

    .venv/bin/python bench/micro_batches.py [--time-budget 4] [--bandwidth-scale X] [--measure-compute]

The fixed count is the baseline, searched in the same run on the same inputs; the last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from compress_swarm import TINY_COMPUTE_S, computed_scale  # (bench/ is on the path: `python bench/X.py`)

from dtfm.control.compute import kind_factors, reference_block_flops, run_model
from dtfm.gossip import reference_block, time_block_ms
from dtfm.scenarios import load_scenario
from dtfm.sched import ScheduleInputs
from dtfm.train import TrainConfig, get_preset


def reference_compute(compute_s: float, batch: int) -> tuple[float, dict[int, float]]:
    """The TFLOP/s at which tiny computes `compute_s` per iteration at 4 x 2 and 4 micro-batches
    (bench/compress_swarm.py `tiny_share_at`: per layer, compute_s / ((M + S - 1) x layers / S)),
    every micro-batch size at that rate."""
    S, D, M = 4, 2, 4
    rm = run_model(get_preset("tiny"), TrainConfig(global_batch_seqs=batch, micro_batches=M))
    layer_s = compute_s / ((M + S - 1) * (rm.layers // S))
    return rm.spec(D, 1.0).layer_flops() / layer_s / 1e12, {}


def measured_compute(batches) -> tuple[float, dict[int, float]]:
    """This machine's reference TFLOP/s (the reference block, best of 3) and the tiny layer's
    `kind_factors` at `batches`."""
    ref, x = reference_block()
    ms = min(time_block_ms(ref, x) for _ in range(3))
    return reference_block_flops() / (ms / 1e3) / 1e12, kind_factors(get_preset("tiny"), batches)


def search(sc, scale: float, tflops: float, kind: dict, auto: bool, args) -> dict:
    cfg = TrainConfig(global_batch_seqs=args.batch, micro_batches=args.micro_batches)
    model = run_model(get_preset("tiny"), cfg, auto_micro_batches=auto)
    n = sc.n_peers
    bw = sc.bandwidth_gbps() * scale
    inputs = ScheduleInputs(tuple(str(i) for i in range(n)), tuple(sc.peer_regions()), sc.delay_ms(), bw,
                            np.ones(n), tflops, kind, model, seed=args.seed, time_budget_s=args.time_budget)
    found = inputs.solve()
    return {"shape": f"{found.alloc.stages}x{found.alloc.dp}", "micro_batches": found.micro_batches,
            "predicted_s": round(found.iteration_s, 4), "note": found.note(n),
            "by_count": {m: round(t, 4) for s, d, m, t in found.tried_micro
                         if (s, d) == (found.alloc.stages, found.alloc.dp)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-budget", type=float, default=4.0, help="seconds of the shape search, each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--micro-batches", type=int, default=TrainConfig().micro_batches, help="the fixed count")
    ap.add_argument("--bandwidth-scale", type=float, default=None,
                    help="the compression bench's scale (default: computed as bench/compress_swarm.py does)")
    ap.add_argument("--measure-compute", action="store_true",
                    help="this machine's compute and layer factors (default: the compression bench's figure)")
    args = ap.parse_args(argv)
    sc = load_scenario("worldwide").scaled(8)
    model = run_model(get_preset("tiny"), TrainConfig(global_batch_seqs=args.batch), auto_micro_batches=True)
    if args.measure_compute:
        tflops, kind = measured_compute(model.micro_batch_sizes(min(sc.n_peers, model.d_max)))
    else:
        tflops, kind = reference_compute(TINY_COMPUTE_S, args.batch)
    scale = args.bandwidth_scale
    if scale is None:
        scale = computed_scale(argparse.Namespace(seed=args.seed, time_budget=args.time_budget,
                                                  tiny_compute_s=TINY_COMPUTE_S))["scale"]
    rows = []
    print(f"tiny, global batch {args.batch}, worldwide 8 peers; compute {tflops * 1e3:.1f} GFLOP/s per peer, "
          + ("layer time per FLOP by micro-batch " + ", ".join(f"{b}: {f:.2f}" for b, f in sorted(kind.items()))
             if kind else "every micro-batch size at that rate"))
    print("| network | fixed M = %d | auto | auto / fixed |" % args.micro_batches)
    print("|---|---|---|---|")
    for name, s in (("paper's (scale 1)", 1.0), (f"compress bench's (scale {scale:.4f})", scale)):
        fixed = search(sc, s, tflops, kind, False, args)
        auto = search(sc, s, tflops, kind, True, args)
        gain = fixed["predicted_s"] / auto["predicted_s"]
        rows.append({"network": name, "scale": s, "fixed": fixed, "auto": auto, "speedup": round(gain, 3)})
        print(f"| {name} | {fixed['shape']}, M {fixed['micro_batches']}: {fixed['predicted_s']:.3f} s | "
              f"{auto['shape']}, M {auto['micro_batches']}: {auto['predicted_s']:.3f} s | {gain:.2f}x |")
        print(f"  auto: {auto['note']}")
    print(json.dumps({"bench": "micro_batches", "compute": "measured" if args.measure_compute else "reference",
                      "reference_tflops": tflops, "kind": kind, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
