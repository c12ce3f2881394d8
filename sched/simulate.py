"""Event-level model of one training iteration under a GPipe schedule.

Each pipeline runs M micro-batches forward through its stages, then M backward (a stage starts
its backward pass once it has finished all its forwards, the GPipe flush). A micro-batch's
activations (forward) or their gradients (backward) cross each boundary over that hop: the
transfer holds the link for volume / bandwidth, and arrives one latency later; transfers on a
link go one at a time, the two directions independently. When a stage's D replicas have all
finished their backward passes, its DP group all-reduces its gradients (the paper's DP cost for
that group); with `overlap_allreduce` that starts while earlier stages are still in backward,
as the trainer does. The iteration ends when the last all-reduce does.

Compute per micro-batch on peer i at stage s: layers[s] * layer_compute_s / compute[i],
one third forward and two thirds backward. With no layer_compute_s, compute is free and the
model predicts communication alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost import CostModel

__all__ = ["SimResult", "simulate"]


@dataclass(frozen=True)
class SimResult:
    iteration_s: float  # start of the first forward to the end of the last all-reduce
    pipeline_s: float  # when the last backward pass ends, before any trailing all-reduce
    stage_done_s: tuple[float, ...]  # per stage: when its all-reduce ends
    allreduce_s: tuple[float, ...]  # per stage: duration of its all-reduce
    compute_busy_s: float  # the busiest peer's total compute time


def simulate(model: CostModel, X: np.ndarray, *, micro_batches: int | None = None,
             overlap_allreduce: bool = True, engine_syncs: bool = False) -> SimResult:
    """Predict the iteration time of allocation X ((S, D): X[s, p] peer of stage s, pipeline p).

    engine_syncs adds the round trips dtfm's trainer spends besides the paper's terms: a stage
    ends its pipeline phase when its last activation and gradient are acknowledged, the last
    stages sum the loss across pipelines, and every stage sums the squared gradient norm with the
    rest of its pipeline (for clipping) after its all-reduce, each message acknowledged."""
    X = np.asarray(X, dtype=np.int64)
    S, D = X.shape
    wl = model.workload
    M = micro_batches or wl.micro_batches
    layers, _ = model.group_layers(X)
    # per hop and micro-batch: latency, and the time the link is held
    n = model.n
    lat = model.dp_a / 2  # one-way latency in seconds
    per_gb = np.where(np.eye(n, dtype=bool), 0.0, model.dp_b * wl.dp / 2)  # seconds per GB
    vol = wl.act_gb / M
    if wl.layer_compute_s is None:
        step = np.zeros((S, D))
    else:
        step = layers[:, None] * wl.layer_compute_s / model.speed[X]  # (S, D) fwd+bwd per micro-batch
    fwd, bwd = step / 3, 2 * step / 3
    if S > 1:
        hold_f = per_gb[X[:-1], X[1:]] * vol  # (S-1, D) boundary s, stage s -> s+1
        lat_f = lat[X[:-1], X[1:]]
        hold_b = per_gb[X[1:], X[:-1]] * vol
        lat_b = lat[X[1:], X[:-1]]
    busy = np.zeros((S, D))  # when each peer's compute is next free
    link_f = np.zeros((max(S - 1, 0), D))
    link_b = np.zeros((max(S - 1, 0), D))
    arrive = np.zeros((S, M, D))
    for m in range(M):
        for s in range(S):
            end = np.maximum(arrive[s, m], busy[s]) + fwd[s]
            busy[s] = end
            if s < S - 1:
                start = np.maximum(end, link_f[s])
                link_f[s] = start + hold_f[s]
                arrive[s + 1, m] = link_f[s] + lat_f[s]
    arrive_f = arrive.copy()
    arrive[:] = 0.0
    for m in range(M):
        for s in range(S - 1, -1, -1):
            end = np.maximum(arrive[s, m], busy[s]) + bwd[s]
            busy[s] = end
            if s > 0:
                start = np.maximum(end, link_b[s - 1])
                link_b[s - 1] = start + hold_b[s - 1]
                arrive[s - 1, m] = link_b[s - 1] + lat_b[s - 1]
    ar = model.dp_rows(X, layers).max(axis=1) if D > 1 else np.zeros(S)
    if engine_syncs:
        done, iteration = _engine_syncs(lat, X, busy, arrive_f, arrive, ar, overlap_allreduce)
        grads_ready = busy.max(axis=1)
    else:
        grads_ready = busy.max(axis=1)  # (S,) every replica of the stage is done
        start = grads_ready if overlap_allreduce else np.full(S, grads_ready.max())
        done = start + ar
        iteration = float(done.max())
    return SimResult(iteration_s=iteration, pipeline_s=float(grads_ready.max()),
                     stage_done_s=tuple(float(v) for v in done), allreduce_s=tuple(float(v) for v in ar),
                     compute_busy_s=float((M * step).max()))


def _engine_syncs(lat: np.ndarray, X: np.ndarray, busy: np.ndarray, arrive_f: np.ndarray, arrive_b: np.ndarray,
                  ar: np.ndarray, overlap_allreduce: bool) -> tuple[np.ndarray, float]:
    """Per-stage all-reduce ends and the iteration end with the trainer's acknowledged sends,
    loss sum and gradient-norm sum (see `simulate`)."""
    S, D = X.shape
    end = busy.copy()  # (S, D) when each peer's pipeline phase ends
    for s in range(S):
        for d in range(D):
            me = X[s, d]
            if s + 1 < S:  # the last activation sent downstream, acknowledged
                end[s, d] = max(end[s, d], arrive_f[s + 1, -1, d] + lat[X[s + 1, d], me])
            if s > 0:  # the last gradient sent upstream, acknowledged
                end[s, d] = max(end[s, d], arrive_b[s - 1, -1, d] + lat[X[s - 1, d], me])
    if D > 1:  # the last stages sum the loss: each waits for the others' and for its acks
        last = X[-1]
        t = end[-1].copy()
        end[-1] = [max(max(t[e] + lat[last[e], last[d]], t[d] + lat[last[d], last[e]] + lat[last[e], last[d]])
                       for e in range(D) if e != d) for d in range(D)]
    ready = end.max(axis=1)
    start = ready if overlap_allreduce else np.full(S, ready.max())
    done = start + ar  # (S,) each stage's group all-reduce ends together
    finish = np.zeros((S, D))
    for d in range(D):  # the gradient norm, summed over the pipeline
        for s in range(S):
            me = X[s, d]
            finish[s, d] = max([done[s]] + [max(done[r] + lat[X[r, d], me], done[s] + lat[me, X[r, d]] + lat[X[r, d], me])
                                            for r in range(S) if r != s])
    return done, float(finish.max())
