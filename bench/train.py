"""Training throughput on CPU: single-process `tiny` vs the same model as 2- and 4-stage
in-memory pipelines; measured pipeline bubble vs GPipe's (S-1)/(M+S-1); memory per stage;
and 2 stages x 2 pipelines behind emulated slow links, with fp32 vs bf16 on the wire.

    .venv/bin/python bench/train.py [--preset tiny] [--steps 6] [--batch 16] [--micro-batches 4]

Bubble: for each stage, the share of its forward/backward phase spent not computing
(waiting for activations or gradients), averaged over stages and steps. Memory per stage:
parameters, gradients and both Adam moments (4 x fp32 per parameter) plus the peak bytes
autograd saved for backward. Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from dtfm.train import Link, LocalCluster, Plan, TrainConfig, get_preset, load_corpus, reference_state, reference_step


def single_process(spec, cfg, corpus, steps: int) -> dict:
    state = reference_state(spec, cfg)
    reference_step(state, corpus)  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        reference_step(state, corpus)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {"step_s": step_s, "tokens_per_s": cfg.global_batch_seqs * spec.seq_len / step_s}


def pipeline(spec, cfg, corpus, stages: int, steps: int) -> dict:
    plan = Plan.grid(spec.n_layer, stages, 1)
    with LocalCluster(spec, cfg, plan, corpus, track_memory=True) as cl:
        cl.step()  # warm-up
        sent0 = cl.hub.bytes_sent
        times, bubbles, act_peak = [], [], {p: 0 for p in plan.peers}
        for _ in range(steps):
            t0 = time.perf_counter()
            cl.step()
            times.append(time.perf_counter() - t0)
            res = cl.last_results
            bubbles.append(statistics.mean(1 - r.compute_s / r.pipeline_s for r in res.values()))
            for p, r in res.items():
                act_peak[p] = max(act_peak[p], r.act_peak_bytes)
        wire_mib = (cl.hub.bytes_sent - sent0) / steps / 2**20
        mem = []
        for p in plan.pipeline(0):
            n_param = sum(t.numel() for t in cl.states[p].params.values())
            mem.append(round((16 * n_param + act_peak[p]) / 2**20, 2))
    step_s = statistics.median(times)
    m = cfg.micro_batches
    return {"stages": stages, "layer_ranges": [list(r) for r in plan.layer_ranges], "step_s": step_s,
            "tokens_per_s": cfg.global_batch_seqs * spec.seq_len / step_s,
            "bubble_measured": statistics.mean(bubbles), "bubble_theory": (stages - 1) / (m + stages - 1),
            "peak_mem_mib_per_stage": mem, "wire_dtype": cfg.wire_dtype, "wire_mib_per_step": round(wire_mib, 3)}


def over_link(spec, cfg, corpus, stages: int, dp: int, steps: int, mbps: float, latency_ms: float) -> dict:
    """S x D on the in-memory Comm with every pair of peers behind the same emulated link."""
    lk = Link(latency_s=latency_ms / 1e3, bandwidth_bytes_per_s=mbps * 1e6 / 8)
    plan = Plan.grid(spec.n_layer, stages, dp)
    with LocalCluster(spec, cfg, plan, corpus, link=lambda a, b: lk) as cl:
        cl.step()  # warm-up
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            cl.step()
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {"stages": stages, "dp": dp, "wire_dtype": cfg.wire_dtype, "link_mbps": mbps, "latency_ms": latency_ms,
            "step_s": step_s, "tokens_per_s": cfg.global_batch_seqs * spec.seq_len / step_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per configuration (after one warm-up)")
    ap.add_argument("--batch", type=int, default=16, help="global batch, sequences")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the single-process run")
    ap.add_argument("--wire-dtype", default="float32", help="dtype of activations/gradients between stages")
    ap.add_argument("--link-mbps", type=float, default=50.0, help="emulated link bandwidth for the 2x2 runs; 0: skip them")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="emulated one-way latency for the 2x2 runs")
    args = ap.parse_args()
    spec = get_preset(args.preset)
    cfg = TrainConfig(global_batch_seqs=args.batch, micro_batches=args.micro_batches, wire_dtype=args.wire_dtype)
    corpus = load_corpus(max_bytes=8 << 20)
    torch.set_num_threads(args.threads)
    single = single_process(spec, cfg, corpus, args.steps)
    print(f"single process: {single['tokens_per_s']:,.0f} tok/s ({single['step_s'] * 1e3:.0f} ms/step)")
    pipes = []
    for s in (2, 4):
        r = pipeline(spec, cfg, corpus, s, args.steps)
        pipes.append(r)
        print(f"{s}-stage pipeline: {r['tokens_per_s']:,.0f} tok/s, bubble {r['bubble_measured']:.3f} "
              f"(GPipe theory {r['bubble_theory']:.3f}), peak MiB per stage {r['peak_mem_mib_per_stage']}, "
              f"{r['wire_mib_per_step']:.2f} MiB on the wire per step")
    linked = []
    if args.link_mbps > 0:
        for wire in ("float32", "bfloat16"):
            c = dataclasses.replace(cfg, wire_dtype=wire)
            r = over_link(spec, c, corpus, 2, 2, max(2, args.steps // 2), args.link_mbps, args.latency_ms)
            linked.append(r)
            print(f"2x2 over {args.link_mbps:g} Mbit/s, {args.latency_ms:g} ms links, {wire} wire: "
                  f"{r['tokens_per_s']:,.0f} tok/s ({r['step_s'] * 1e3:.0f} ms/step)")
    print(json.dumps({"bench": "train", "preset": spec.name, "params": spec.params, "global_batch": args.batch,
                      "micro_batches": args.micro_batches, "seq_len": spec.seq_len, "cpu_threads": torch.get_num_threads(),
                      "single": single, "pipelines": pipes, "emulated_links": linked}))


if __name__ == "__main__":
    main()
