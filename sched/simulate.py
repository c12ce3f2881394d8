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
one third forward and two thirds backward, scaled by the workload's micro-batches over the M
simulated (the workload counts the largest pipeline's sequences: 16 over 3 pipelines is 6
sequences, not 3 x 4 / 3 x 4 = 4). After its stage's all-reduce (and, with engine_syncs, the
gradient-norm sum) each peer runs its optimizer update: the stage's parameters at the
workload's `update_s_per_param`, at the peer's speed. With no layer_compute_s, compute is free
and the model predicts communication alone.

Compression (`codecs`, a `CodecAssignment`; by default the model's own cheapest codec per link
and group, all exact for an exact model): a link coding with int8/int4 holds the link for its
payload's bytes, the sender encodes each micro-batch after computing it and the receiver
decodes it before computing, both on the peer's compute timeline, each at its own speed when
the model's options give per-peer speeds. A DP group's synchronisation
is its codec's (an all-gather of compressed payloads, coding included); a DiLoCo group
synchronises once every H steps, so the iteration time is the mean over one cycle of
synchronisations (the least common multiple of the groups' periods). A DiLoCo group whose
exchange overlaps the next tau inner steps (`overlap_steps`, streaming DiLoCo's delayed outer
update) pays on its synchronising step its coding (encode and decode, on the compute timeline)
and only the part of its exchange that tau steps without a synchronisation do not cover.

The order of each stage's micro-batches (`warmups`): stage s runs `warmups[s]` forwards, then
alternates one forward and one backward until its forwards are done, then the rest of its
backwards, backwards in micro-batch order (the 1F1B family; the trainer's
`TrainConfig.pipeline_warmups`). With every count at M (the default) that is GPipe: all
forwards, then all backwards. Fewer warm-up
forwards let a stage's backward pass start while later micro-batches still flow forward, so a
link carries activations one way and gradients the other at once; a stage can then have only
warmups[s] - warmups[s + 1] + 1 micro-batches in flight to its neighbour, so each count must
cover its hop's round trip (`fitted_warmups`). The counts must not rise along the pipeline
(else a stage would wait for a backward its neighbour runs only after a forward it has not
sent).

Per-hop latency is paid once in the pipeline's fill and drain whatever M is. What makes a
micro-batch pay latency again is the trainer's flow control (`window_messages`): a sender keeps
at most that many messages unacknowledged per destination (control/dataplane, the receiver
acknowledges once a message is in its buffer), so with more micro-batches than the window a
message waits for the acknowledgement of the one `window_messages` before it: one round trip
per window of micro-batches on each hop.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .compression import CodecAssignment
from .cost import CostModel

__all__ = ["FittedSchedule", "SimResult", "TRAINER_WINDOW_MESSAGES", "check_warmups", "fitted_warmups", "simulate",
           "stage_order"]

# The trainer's unacknowledged messages per destination (control/dataplane CommConfig's default
# `window_messages`; tests/sched check they agree).
TRAINER_WINDOW_MESSAGES = 8


@dataclass(frozen=True)
class SimResult:
    iteration_s: float  # start of the first forward to the end of the last all-reduce (engine_syncs: steps back to back)
    pipeline_s: float  # when the last backward pass ends, before any trailing all-reduce
    stage_done_s: tuple[float, ...]  # per stage: when its all-reduce ends
    allreduce_s: tuple[float, ...]  # per stage: duration of its all-reduce
    compute_busy_s: float  # the busiest peer's total compute time
    # per stage: steps per synchronisation (1, or H for DiLoCo); iteration_s is the mean over a
    # cycle, stage_done_s and allreduce_s are those of a step where every group synchronises
    sync_every: tuple[int, ...] = ()
    # per stage: what its synchronising step pays for the DP sync: allreduce_s, or for a group
    # whose exchange overlaps later steps its coding and the part of the exchange they do not hide
    exposed_sync_s: tuple[float, ...] = ()
    # a step where no group synchronises (None when every step of the cycle synchronises)
    local_iteration_s: float | None = None

# The longest cycle of synchronisation periods simulated (least common multiple of the H's).
MAX_SYNC_CYCLE = 10_000
DESCENT_ROUNDS = 4  # `fitted_warmups`' rounds of moving one count at a time
STEADY_ROUNDS = 4  # steps simulated back to back for engine_syncs' iteration time (mean of the last 3)


def simulate(model: CostModel, X: np.ndarray, *, micro_batches: int | None = None,
             overlap_allreduce: bool = True, engine_syncs: bool = False,
             codecs: CodecAssignment | None = None, window_messages: int | None = None,
             warmups: Sequence[int] | None = None) -> SimResult:
    """Predict the iteration time of allocation X ((S, D): X[s, p] peer of stage s, pipeline p).

    engine_syncs adds the waits dtfm's trainer spends besides the paper's terms: the last stages
    sum the loss across pipelines, and every stage sums the squared gradient norm with the rest
    of its pipeline (for clipping) after its all-reduce, each waiting for the others' values
    (one way; the trainer waits for its sends' acknowledgements a step later, off the critical
    path: train/worker.py). Each peer then starts its next step at once, the first stage before
    the farthest peer has its last norm: the iteration time is that of steps run back to back
    (the mean of rounds 2-4 of `STEADY_ROUNDS`, each peer starting where it ended the round
    before), not of one step from a common start.

    window_messages: at most this many pipeline messages unacknowledged per link and direction
    (the trainer's is TRAINER_WINDOW_MESSAGES); a message is acknowledged one latency after it
    arrives. None: no window (the paper's model).

    warmups: each stage's forwards before its first backward (see the module docstring; None:
    GPipe, every count M)."""
    if window_messages is not None and window_messages < 1:
        raise ValueError(f"window_messages must be at least 1, got {window_messages}")
    X = np.asarray(X, dtype=np.int64)
    S, D = X.shape
    wl = model.workload
    M = micro_batches or wl.micro_batches
    order = stage_order(S, M, check_warmups(warmups, S, M))
    layers, _ = model.group_layers(X)
    if codecs is None:
        codecs = model.assignment(X) if not model.options.exact else CodecAssignment.uniform(S, D)
    codecs.check(S, D)
    # per hop and micro-batch: latency, and the time the link is held
    lat = model.lat_s  # one-way latency in seconds
    per_gb = model.sim_s_per_gb  # seconds per GB
    vol = wl.act_gb / M
    if wl.layer_compute_s is None:
        step = np.zeros((S, D))
    else:
        # the workload's micro-batches (of its micro_batch_size sequences: the largest pipeline's
        # share of the global batch) computed in M: each of the M carries their sequences
        per_mb = wl.layer_compute_s * wl.micro_batches / M
        step = wl.compute_layers(layers)[:, None] * per_mb / model.speed[X]  # (S, D) fwd+bwd per micro-batch
    update = wl.update_s(layers)[:, None] / model.speed[X]  # (S, D) each peer's optimizer update
    fwd, bwd = step / 3, 2 * step / 3
    # (S-1, D) coding seconds per micro-batch on each link: forward, stage s encodes and s+1
    # decodes; backward, s+1 encodes and s decodes (each at its own peer's speed)
    enc_f, dec_f = np.zeros((max(S - 1, 0), D)), np.zeros((max(S - 1, 0), D))
    enc_b, dec_b = np.zeros((max(S - 1, 0), D)), np.zeros((max(S - 1, 0), D))
    ratio = np.ones((max(S - 1, 0), D))
    for s in range(S - 1):
        for p, c in enumerate(codecs.pp[s]):
            if not c.exact:
                ratio[s, p] = model.pp_ratio(c)
                enc_v, dec_v = model.peer_pp_coding_s(c)
                i, j = X[s, p], X[s + 1, p]
                enc_f[s, p], dec_f[s, p] = enc_v[i], dec_v[j]
                enc_b[s, p], dec_b[s, p] = enc_v[j], dec_v[i]
    if S > 1:
        hold_f = per_gb[X[:-1], X[1:]] * vol * ratio  # (S-1, D) boundary s, stage s -> s+1
        lat_f = lat[X[:-1], X[1:]]
        hold_b = per_gb[X[1:], X[:-1]] * vol * ratio
        lat_b = lat[X[1:], X[:-1]]
    def gpipe(begin: np.ndarray) -> np.ndarray:
        """When each peer's last backward ends, each starting its step at `begin` (S, D)."""
        busy = begin.copy()  # when each peer's compute is next free
        link_f = np.zeros((max(S - 1, 0), D))
        link_b = np.zeros((max(S - 1, 0), D))
        arrive_f = np.zeros((S, M, D))  # activation m at stage s
        arrive_b = np.zeros((S, M, D))  # the gradient of micro-batch m at stage s
        W = window_messages
        for s, backward, m in order:  # (each stage's messages leave in micro-batch order)
            if not backward:
                end = np.maximum(arrive_f[s, m], busy[s]) + fwd[s]
                if s > 0:
                    end = end + dec_f[s - 1]  # decode what arrived (0 on an exact link)
                if s < S - 1:
                    end = end + enc_f[s]  # encode what leaves
                busy[s] = end
                if s < S - 1:
                    start = np.maximum(end, link_f[s])
                    if W is not None and m >= W:  # the acknowledgement of the message W before
                        start = np.maximum(start, arrive_f[s + 1, m - W] + lat_b[s])
                    link_f[s] = start + hold_f[s]
                    arrive_f[s + 1, m] = link_f[s] + lat_f[s]
            else:
                end = np.maximum(arrive_b[s, m], busy[s]) + bwd[s]
                if s < S - 1:
                    end = end + dec_b[s]
                if s > 0:
                    end = end + enc_b[s - 1]
                busy[s] = end
                if s > 0:
                    start = np.maximum(end, link_b[s - 1])
                    if W is not None and m >= W:
                        start = np.maximum(start, arrive_b[s - 1, m - W] + lat_f[s - 1])
                    link_b[s - 1] = start + hold_b[s - 1]
                    arrive_b[s - 1, m] = link_b[s - 1] + lat_b[s - 1]
        return busy

    busy = gpipe(np.zeros((S, D)))
    if D > 1 and all(c.exact for c in codecs.dp):
        ar = model.dp_rows_codec(X, layers, codecs.dp[0])
        ar = ar.max(axis=1)
    elif D > 1:
        ar = np.array([model.dp_rows_codec(X[s:s + 1], layers[s:s + 1], c, amortised=False).max()
                       for s, c in enumerate(codecs.dp)])
    else:
        ar = np.zeros(S)
    period = [c.period_steps if D > 1 else 1 for c in codecs.dp]
    cycle = math.lcm(*period)
    if cycle > MAX_SYNC_CYCLE:
        raise ValueError(f"the groups' synchronisation periods {sorted(set(period))} repeat only every "
                         f"{cycle} steps (at most {MAX_SYNC_CYCLE} are simulated)")
    grads_ready = busy.max(axis=1)  # (S,) every replica of the stage is done
    # steps of the cycle by the set of groups that synchronise at them (the last of each period)
    patterns: dict[tuple[bool, ...], int] = {}
    for k in range(cycle):
        key = tuple(k % p == p - 1 for p in period)
        patterns[key] = patterns.get(key, 0) + 1
    # an overlapped DiLoCo group (`overlap_steps` = tau) pays its coding on the step it
    # synchronises, and of its exchange only what tau steps without a synchronisation do not hide
    over = np.array([c.overlap_steps if D > 1 else 0 for c in codecs.dp])
    coding = _dp_coding_s(model, X, layers, codecs) if over.any() else np.zeros(S)
    exchange = np.maximum(ar - coding, 0.0)

    def iterate(ar_k: np.ndarray) -> tuple[np.ndarray, float]:
        if engine_syncs:  # steps repeated, each peer starting the next where it ended the last
            done_k, finish = _engine_syncs(lat, X, busy, ar_k, overlap_allreduce)
            finish = finish + update
            first = float(finish.max())
            for _ in range(STEADY_ROUNDS - 1):
                finish = _engine_syncs(lat, X, gpipe(finish), ar_k, overlap_allreduce)[1] + update
            return done_k, (float(finish.max()) - first) / (STEADY_ROUNDS - 1)
        start = grads_ready if overlap_allreduce else np.full(S, grads_ready.max())
        done_k = start + ar_k
        return done_k, float((done_k + update.max(axis=1)).max())

    exposed_ar, local_s = ar, None
    if over.any():  # hidden behind tau steps where no group synchronises (the exchange's own
        # links are the DP group's; the pipeline's transfers of those steps are not counted against it)
        local_s = iterate(np.zeros(S))[1]
        exposed_ar = np.where(over > 0, coding + np.maximum(exchange - over * local_s, 0.0), ar)
    total = 0.0
    done = np.zeros(S)
    for key, count in patterns.items():
        done_k, iteration = iterate(np.where(key, exposed_ar, 0.0))
        if not any(key):
            local_s = iteration
        total += count * iteration
        if all(key):
            done = done_k
    return SimResult(iteration_s=total / cycle if len(patterns) > 1 else total, pipeline_s=float(grads_ready.max()),
                     stage_done_s=tuple(float(v) for v in done), allreduce_s=tuple(float(v) for v in ar),
                     compute_busy_s=float((M * step + update).max()), sync_every=tuple(period),
                     exposed_sync_s=tuple(float(v) for v in exposed_ar),
                     local_iteration_s=None if local_s is None else float(local_s))


def _dp_coding_s(model: CostModel, X: np.ndarray, layers: np.ndarray, codecs: CodecAssignment) -> np.ndarray:
    """(S,) seconds the slowest member of each DP group spends coding one synchronisation (its
    own payload encoded, every member's decoded), at each peer's speed; 0 for an exact group."""
    S, D = X.shape
    wl, opts = model.workload, model.options
    out = np.zeros(S)
    for s, c in enumerate(codecs.dp):
        if c.exact:
            continue
        elems = c.candidates(int(round(wl.grad_gb(layers[s]) * 1e9 / wl.grad_elem_bytes)))
        speeds = opts.peer_speeds or (opts.speed,) * model.n
        out[s] = max(c.coding_ns_per_elem(speeds[i], D) for i in X[s]) * elems * 1e-9
    return out


def _engine_syncs(lat: np.ndarray, X: np.ndarray, busy: np.ndarray, ar: np.ndarray,
                  overlap_allreduce: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per-stage all-reduce ends (S,) and when each peer's step ends (S, D), with the trainer's
    loss sum and gradient-norm sum (see `simulate`)."""
    S, D = X.shape
    end = busy.copy()  # (S, D) when each peer's pipeline phase ends
    if D > 1:  # the last stages sum the loss: each waits for the others' values
        last = X[-1]
        t = end[-1].copy()
        end[-1] = [max([t[d]] + [t[e] + lat[last[e], last[d]] for e in range(D) if e != d]) for d in range(D)]
    ready = end.max(axis=1)
    start = ready if overlap_allreduce else np.full(S, ready.max())
    done = start + ar  # (S,) each stage's group all-reduce ends together
    finish = np.zeros((S, D))
    for d in range(D):  # the gradient norm, summed over the pipeline
        for s in range(S):
            me = X[s, d]
            finish[s, d] = max([done[s]] + [done[r] + lat[X[r, d], me] for r in range(S) if r != s])
    return done, finish


MAX_WARMUP = 1 << 16  # a warm-up count's bound (a count of M or more runs every forward first)


def check_warmups(warmups: Sequence[int] | None, S: int | None, M: int) -> tuple[int, ...]:
    """Each stage's warm-up forwards, each at most M (a larger count means every forward first;
    None: GPipe, M each); ValueError unless there is one per stage (S None: any number), each in
    [0, MAX_WARMUP], none above the one before it."""
    if warmups is None:
        return (M,) * (S or 0)
    w = tuple(int(v) for v in warmups)
    if S is not None and len(w) != S:
        raise ValueError(f"warmups: expected {S} counts (one per stage), got {len(w)}")
    if any(not 0 <= v <= MAX_WARMUP for v in w):
        raise ValueError(f"warmups: each count must be in [0, {MAX_WARMUP}], got {list(w)[:8]}")
    if any(a < b for a, b in zip(w, w[1:])):
        raise ValueError(f"warmups: a stage may not warm up with more forwards than the one before it, "
                         f"got {list(w)[:8]}")
    return tuple(min(v, M) for v in w)


def stage_program(s: int, M: int, warmup: int) -> list[tuple[bool, int]]:
    """Stage s's micro-batches in the order it runs them, (backward, m) each: `warmup` forwards,
    then one forward and one backward at a time, then the remaining backwards."""
    w = min(warmup, M)
    out = [(False, m) for m in range(w)]
    for k in range(M - w):
        out += [(False, w + k), (True, k)]
    return out + [(True, m) for m in range(M - w, M)]


@functools.lru_cache(maxsize=256)
def stage_order(S: int, M: int, warmups: tuple[int, ...]) -> tuple[tuple[int, bool, int], ...]:
    """Every stage's programme merged into one order in which each step's inputs come first
    (an activation from the stage before, a gradient from the stage after): (s, backward, m).
    (Cached: the searches simulate a few shapes thousands of times.)"""
    progs = [stage_program(s, M, warmups[s]) for s in range(S)]
    done_f = [0] * S  # forwards done per stage (in micro-batch order)
    done_b = [0] * S
    pos = [0] * S
    out: list[tuple[int, bool, int]] = []
    while len(out) < S * 2 * M:
        moved = False
        for s in range(S):
            while pos[s] < len(progs[s]):
                backward, m = progs[s][pos[s]]
                ready = (done_b[s + 1] > m if s < S - 1 else done_f[s] > m) if backward else \
                    (s == 0 or done_f[s - 1] > m)
                if not ready:
                    break
                out.append((s, backward, m))
                if backward:
                    done_b[s] += 1
                else:
                    done_f[s] += 1
                pos[s] += 1
                moved = True
        if not moved:  # (check_warmups rules this out)
            raise ValueError(f"warmups {list(warmups)} deadlock the pipeline")
    return tuple(out)


class FittedSchedule(NamedTuple):
    """`fitted_warmups`' answer."""

    warmups: tuple[int, ...] | None  # each stage's warm-up forwards; None: GPipe is as fast
    iteration_s: float  # the simulated iteration under them
    gpipe_s: float  # ... and under GPipe


def fitted_warmups(model: CostModel, X: np.ndarray, micro_batches: int | None = None,
                   window_messages: int | None = None, codecs: CodecAssignment | None = None,
                   engine_syncs: bool = True) -> FittedSchedule:
    """The warm-up counts the simulator finds fastest for allocation X, with its iteration time
    and GPipe's (the warm-ups None where nothing beats GPipe): GPipe against counts fitted to each hop's round trip (a hop needs as many micro-batches in
    flight as its two latencies and two transfers take, in transfers or computes, whichever is
    longer; a stage's count is the sum over the hops after it, every pipeline's longest), at
    half, one and twice that; the best of those then moved one count at a time while that is
    faster (`DESCENT_ROUNDS` rounds at most). Ties go to the larger counts (GPipe first)."""
    X = np.asarray(X, dtype=np.int64)
    S, D = X.shape
    M = micro_batches or model.workload.micro_batches
    gpipe = (M,) * S
    def run(w: tuple[int, ...]) -> float:
        return float(simulate(model, X, micro_batches=M, engine_syncs=engine_syncs, codecs=codecs,
                              window_messages=window_messages, warmups=w).iteration_s)
    gpipe_s = run(gpipe)
    best = (gpipe_s, gpipe)
    if S < 2 or M < 2:
        return FittedSchedule(None, gpipe_s, gpipe_s)
    need = _hop_flight(model, X, M, codecs)  # (S-1,) micro-batches each hop needs in flight
    tried = {gpipe}
    for scale in (1.0, 0.5, 2.0):
        w = tuple(min(M, int(math.ceil(scale * float(need[s:].sum())))) for s in range(S - 1)) + (0,)
        if w in tried:
            continue
        tried.add(w)
        t = run(w)
        if t < best[0] - 1e-12:
            best = (t, w)
    for _ in range(DESCENT_ROUNDS):  # each count one lower or higher, while that is faster
        moved = False
        for s in range(S):
            for step in (-1, 1):
                w = best[1][:s] + (best[1][s] + step,) + best[1][s + 1:]
                if w in tried or not 0 <= w[s] <= M or any(a < b for a, b in zip(w, w[1:])):
                    continue
                tried.add(w)
                t = run(w)
                if t < best[0] - 1e-12:
                    best, moved = (t, w), True
        if not moved:
            break
    return FittedSchedule(None if best[1] == gpipe else best[1], best[0], gpipe_s)


def _hop_flight(model: CostModel, X: np.ndarray, M: int, codecs: CodecAssignment | None) -> np.ndarray:
    """(S-1,) per hop: its round trip (both latencies and both transfers of one micro-batch)
    over the longer of a transfer and a stage's compute per micro-batch, the most any pipeline needs."""
    S, D = X.shape
    wl = model.workload
    if codecs is None:
        codecs = model.assignment(X) if not model.options.exact else CodecAssignment.uniform(S, D)
    vol = wl.act_gb / M
    layers, _ = model.group_layers(X)
    if wl.layer_compute_s is None:
        step = np.zeros((S, D))
    else:
        step = wl.compute_layers(layers)[:, None] * (wl.layer_compute_s * wl.micro_batches / M) / model.speed[X]
    out = np.zeros(S - 1)
    for s in range(S - 1):
        for p in range(D):
            c = codecs.pp[s][p]
            ratio = 1.0 if c.exact else model.pp_ratio(c)
            i, j = X[s, p], X[s + 1, p]
            hf, hb = model.sim_s_per_gb[i, j] * vol * ratio, model.sim_s_per_gb[j, i] * vol * ratio
            rtt = model.lat_s[i, j] + model.lat_s[j, i] + hf + hb + step[s, p] + step[s + 1, p]
            unit = max(hf, hb, step[s, p], step[s + 1, p], 1e-9)
            out[s] = max(out[s], math.ceil(rtt / unit))
    return out
