"""The fastest shape of a run: every count of stages and pipelines the peers allow, spares
included, each searched with `solve` and simulated with the trainer's syncs; the shape the
simulator predicts fastest per step wins (the global batch is the run's whatever the shape, so
the fastest step is the fastest to the run's target).

A run whose operator left the micro-batch count to the scheduler (`--micro-batches auto`) has
it searched too: each shape's allocation is simulated at every count M of
`micro_batch_options` (M divides the per-pipeline batch, at most MAX_MICRO_BATCHES), with the
model's compute at that micro-batch's size and speed (`spec_of(D, M)`), and the fastest (S, D,
M) wins. More micro-batches shrink the GPipe bubble (the S - 1 micro-batches' compute and
transfer before the last stage starts); each micro-batch still pays every hop's latency in
that bubble, and smaller micro-batches compute slower per FLOP, so where latency dominates
fewer and larger micro-batches are as fast or faster.

The search minimises the paper's cost (sched/cost.py), which ranks allocations otherwise than
the simulator does where latency binds (compressed tiny as 4 x 2 on the paper's eight cities:
the search's best by that cost simulates 0.739 s per step, refined 0.637 s, the optimum of all
20,160 allocations, at a paper's cost 3 % higher). Each shape's allocation is then refined on
the simulator itself (`refine_by_simulation`: from the faster of it and its reversed stage
order, swaps of two placed peers, or of a placed peer and a spare, kept while the simulated
iteration falls, then a kick of two random swaps and again, until three descents in a row find
nothing better), with the run's codecs where it compresses, within a share of that shape's
budget (`REFINE_SHARE`) and up to `REFINE_MAX_PEERS` peers.

A run whose stages order their forwards and backwards as the simulator fits them
(`fit_schedules`: 1F1B with warm-ups fitted to the links, `fitted_warmups`) has its shapes
ranked under those schedules: the search and refinement cost GPipe (a fit costs 10-20
simulations), then the (S, D, M) candidates are fitted in order of their GPipe time, while
that is within `SCHEDULE_GAIN_BOUND` of the best fitted time so far (a fitted schedule can only
overlap a hop's two directions: it saves at most the transfers GPipe pays one way after the
other) and within the budget's `FIT_SHARE`; the fastest under its schedule wins where it is
predicted faster than GPipe's winner under its own by more than `SCHEDULE_MARGIN` (the
simulator's error), else GPipe's winner stays. A shape that GPipe ranks second can win this
way: 1F1B gains most where one hop carries the most.

A swarm's coordinator chooses a new run's shape this way (control/coordinator/schedule.py
`choose_shape`), and writes its inputs to a view file (`ScheduleInputs`, JSON) that
`dtfm-sched solve --view FILE` replays offline: the same search on the same inputs.

    found = solve_fastest(delay_ms, bandwidth_gbps, spec_of, shape_space(8, 4, 4), micro_batches=4)
    found.alloc, found.iteration_s, found.micro_batches, found.note(8)
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from .compression import CompressionOptions, shape_step_efficiency
from .cost import CostModel
from .search import SearchConfig
from .simulate import TRAINER_WINDOW_MESSAGES, fitted_warmups, simulate
from .solve import Allocation, cost_model, solve
from .spec import ModelSpec, update_s_per_param

__all__ = ["FIT_SHARE", "FastestShape", "fit_in_order", "MAX_MICRO_BATCHES", "RunModel", "ScheduleInputs", "VIEW_FORMAT", "micro_batch_options",
           "refine_by_simulation", "SCHEDULE_GAIN_BOUND", "SCHEDULE_MARGIN", "shape_space", "solve_fastest"]

VIEW_FORMAT = "dtfm-schedule-inputs-v1"
MAX_VIEW_BYTES = 64 << 20  # a view file's bound (a 1,000-peer view is about 30 MB of JSON)
# The most micro-batches per pipeline the scheduler chooses (`--micro-batches auto`) and a peer
# accepts from it: beyond this the bubble is under 1/64 of a step per stage while every
# micro-batch adds a message per hop and a smaller, slower matrix product (GPT-3 XL's paper
# setting, 61 of one sequence, is inside it).
MAX_MICRO_BATCHES = 64
# Of each shape's search budget, the share its allocation's refinement on the simulator uses,
# and the most peers it is tried on (a swap pass costs (N choose 2) simulations).
REFINE_SHARE = 0.25
REFINE_MAX_PEERS = 64
# With `fit_schedules`: the share of the budget kept for fitting the candidates' pipeline
# schedules (the winner of GPipe is always fitted), and how much faster than GPipe a fitted
# schedule is taken to be at most (it overlaps a hop's two directions, no more).
FIT_SHARE = 0.1
SCHEDULE_GAIN_BOUND = 2.0
# ... and how much faster under its schedule another candidate must be predicted than GPipe's
# winner under its own to take its place: the simulator's error on the swarms measured under
# fitted schedules (bench/schedule.py: within 5 % exact, 8 % `slow-link`; the demo's `tiny` on
# one peer or two, 18-38 % short, about alike for both). A smaller predicted gain may be none:
# the demo's two-peer 1F1B pipeline, predicted 8 % faster than one peer, stepped 0.349 s
# against one peer's 0.249-0.335 s (2026-11-30).
SCHEDULE_MARGIN = 0.1


def micro_batch_options(global_batch: int, dp: int, max_m: int = MAX_MICRO_BATCHES) -> tuple[int, ...]:
    """The micro-batch counts the scheduler may choose for D = `dp` pipelines of a global batch
    of `global_batch` sequences: every M that divides the per-pipeline batch (global // D, the
    smaller pipeline's where D does not divide it), so each micro-batch holds the same number
    of sequences, at most `max_m`; ascending. Empty when a pipeline would get no sequence."""
    per = global_batch // dp if dp >= 1 else 0
    return tuple(m for m in range(1, min(per, max_m) + 1) if per % m == 0)


def shape_space(n: int, layers: int, d_max: int, *, stages: int | None = None, dp: int | None = None,
                compute_costed: bool = True, even_layers: bool = True) -> list[tuple[int, int]]:
    """Every (S, D) a run may take on n peers: S divides the layers (an even split; any S up
    to the layers without `even_layers`), S x D at most n (peers left out are spares), D at
    most `d_max` (each pipeline's micro-batches at least one sample); `stages` or `dp` fix one
    of the two; the widest D of each S first. Without `compute_costed` (no peer's compute
    known, so fewer peers would always look faster) and without `dp`: with `stages`, only
    the widest D; else the widest D of each S and one fewer."""
    out = []
    for S in range(1, min(layers, n) + 1):
        if (even_layers and layers % S) or (stages is not None and S != stages):
            continue
        widest = min(n // S, max(1, d_max))
        narrowest = 1 if compute_costed or dp is not None else widest - (0 if stages is not None else 1)
        for D in range(widest, 0, -1):
            if (dp is None or D == dp) and D >= narrowest:
                out.append((S, D))
    return out


@dataclass(frozen=True)
class FastestShape:
    alloc: Allocation  # the fastest shape's allocation
    iteration_s: float  # its simulated iteration
    tried: tuple[tuple[int, int, float], ...]  # (S, D, simulated iteration at its best M) of every shape searched
    micro_batches: int = 0  # the chosen M (0: not recorded)
    # (S, D, M, simulated iteration) of every micro-batch count costed, when more than one was
    tried_micro: tuple[tuple[int, int, int, float], ...] = ()
    # (S, D, step efficiency) of each shape searched whose codecs lose steps (below 1): it was
    # ranked by its iteration over that, the time per exact step's worth of progress
    efficiency: tuple[tuple[int, int, float], ...] = ()
    # (S, D, M, iteration under the schedule fitted to it, its warm-ups or None for GPipe) of
    # each candidate whose schedule was fitted (`fit_schedules`), the chosen one first
    scheduled: tuple[tuple[int, int, int, float, tuple[int, ...] | None], ...] = ()

    @property
    def scheduled_s(self) -> float:
        """The chosen allocation's iteration under its fitted schedule (GPipe's where none was)."""
        return self.scheduled[0][3] if self.scheduled else self.iteration_s

    @property
    def warmups(self) -> tuple[int, ...] | None:
        """The chosen allocation's fitted warm-ups (None: GPipe, or not fitted)."""
        return self.scheduled[0][4] if self.scheduled else None

    def note(self, n: int) -> str:
        """Why the shape, in one line: "4 x 1 (4 spares): predicted 0.412 s/step; every peer
        placed (4 x 2) 0.650 s; next 2 x 2 0.520 s (11 shapes tried)": the chosen shape, the
        best that places every peer when the chosen one leaves some out, the best of the rest.
        When the micro-batch count was searched, the chosen one follows the shape and the
        runner-up count on the same shape its prediction: "4 x 1 (4 spares), 8 micro-batches:
        predicted 0.412 s/step; 4 micro-batches 0.450 s; ...". Where schedules were fitted, each
        figure is the candidate's under its fitted schedule (GPipe's where it was not fitted),
        and the chosen one's GPipe figure follows it: "... 0.310 s/step in 1F1B (GPipe 0.412 s)"."""
        S, D = self.alloc.stages, self.alloc.dp
        at = {(s, d, m): t for s, d, m, t in self.tried_micro}  # (S, D, M): the ranked time
        by = {(s, d): t for s, d, t in self.tried}
        for s, d, m, t, _ in self.scheduled:
            at[(s, d, m)] = t
            by[(s, d)] = min(t, by.get((s, d), t))
        chosen_s = by[(S, D)] = self.scheduled_s if self.scheduled else by.get((S, D), self.iteration_s)
        eff = {(s, d): e for s, d, e in self.efficiency}

        def per_exact(s: int, d: int) -> str:  # the time to the target per exact step, where it differs
            e = eff.get((s, d), 1.0)
            return f" ({by[(s, d)] / e:.3f} s per exact step at step efficiency {e:.2f})" if e < 1.0 else ""

        spares = n - S * D
        out = f"{S} x {D}" + (f" ({spares} spare{'s' if spares != 1 else ''})" if spares else "")
        others = sorted((t, m) for (s, d, m), t in at.items() if (s, d) == (S, D) and m != self.micro_batches)
        if self.tried_micro:
            out += f", {self.micro_batches} micro-batch{'es' if self.micro_batches != 1 else ''}"
        out += f": predicted {chosen_s:.3f} s/step" + per_exact(S, D)
        if self.warmups is not None:
            out += f" in 1F1B (GPipe {self.iteration_s:.3f} s)"
        if others:
            t, m = others[0]
            out += f"; {m} micro-batch{'es' if m != 1 else ''} {t:.3f} s"
        rest = sorted((t / eff.get((s, d), 1.0), t, s, d) for (s, d), t in by.items() if (s, d) != (S, D))
        full = [x for x in rest if x[2] * x[3] == n]
        if spares and full:
            _, t, s, d = full[0]
            out += f"; every peer placed ({s} x {d}) {t:.3f} s" + per_exact(s, d)
            rest.remove(full[0])
        if rest:
            _, t, s, d = rest[0]
            out += f"; next {s} x {d} {t:.3f} s" + per_exact(s, d)
        k = len(self.tried)
        fitted = f", {len(self.scheduled)} schedules fitted" if self.scheduled else ""
        return out + f" ({k} shape{'s' if k != 1 else ''} tried{fitted})"


def solve_fastest(delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, spec_of: Callable[..., ModelSpec],
                  shapes: Sequence[tuple[int, int]], *, micro_batches: int, compute: np.ndarray | None = None,
                  regions: Sequence[str] | None = None, seed: int = 0, time_budget_s: float = 5.0,
                  compression: CompressionOptions | None = None,
                  micro_options: Callable[[int], Sequence[int]] | None = None,
                  window_messages: int | None = None, fit_schedules: bool = False) -> FastestShape:
    """`solve` on each shape (`spec_of(D)`: the model for D pipelines, its compute term on when
    it has `reference_tflops`), the budget shared among the shapes; each result simulated with
    the trainer's syncs at `micro_batches`, compute at `compute` (per-peer speeds); the fastest
    wins (on a tie, the first). With many peers (the hierarchical search's range) the search
    costs no compute; the simulator still does. `compression`: the codecs the search may give
    each link and group, and the simulator costs each link's and group's cheapest
    (`CostModel.assignment`). Each shape's allocation is refined on the simulator
    (`refine_by_simulation`, at most `REFINE_SHARE` of its budget, up to `REFINE_MAX_PEERS`
    peers; its figures in `alloc.stats["refined"]`). With `compression`, shapes are ranked by
    time to the target loss, the iteration over the shape's step efficiency
    (`shape_step_efficiency`: one pipeline has no DP group to lose steps on). ValueError when
    `shapes` is empty.

    `micro_options(D)`: the micro-batch counts to cost for D pipelines (`micro_batch_options`);
    then `spec_of(D, M)` is the model at M micro-batches, each shape's allocation is searched at
    the count nearest `micro_batches` and simulated at every count, and the fastest (S, D, M)
    wins (on a tie, the fewer micro-batches: fewer messages for the same predicted time).
    `window_messages`: the trainer's flow-control window the simulator costs (`simulate`).
    `fit_schedules`: the candidates are ranked under the pipeline schedule fitted to each
    (`fitted_warmups`; the module's docstring says which are fitted), and the result names the
    chosen one's (`FastestShape.warmups`, `scheduled_s`); `iteration_s` stays its GPipe time."""
    if not shapes:
        raise ValueError("no shape to search")
    n = np.asarray(delay_ms).shape[0]
    flat = n < SearchConfig().hierarchy_min_peers
    t0 = time.monotonic()
    tried: list[tuple[int, int, float]] = []
    tried_micro: list[tuple[int, int, int, float]] = []
    efficiency: list[tuple[int, int, float]] = []
    best: tuple[float, Allocation, int, float] | None = None  # (time per exact step, allocation, M, iteration)
    # (time per exact step, iteration, S, D, M, allocation, step efficiency, cost model) of every
    # candidate, for the fits
    cands: list[tuple[float, float, int, int, int, Allocation, float, CostModel]] = []
    search_s = time_budget_s * (1 - FIT_SHARE if fit_schedules else 1.0)
    for k, (S, D) in enumerate(shapes):
        budget = max(search_s - (time.monotonic() - t0), 0.0) / (len(shapes) - k)
        counts = list(micro_options(D)) if micro_options is not None else []
        if micro_options is not None and not counts:
            continue  # (no micro-batch count fits D pipelines)
        m0 = min(counts, key=lambda m: (abs(m - micro_batches), m)) if counts else micro_batches

        def spec_at(m: int) -> ModelSpec:
            return spec_of(D, m) if micro_options is not None else spec_of(D)

        mspec = spec_at(m0)
        costed = flat and compute is not None and mspec.reference_tflops is not None
        searched = mspec if costed or mspec.reference_tflops is None else _without_compute(mspec)
        refine = n <= REFINE_MAX_PEERS and S * D > 1
        shape_t0 = time.monotonic()
        alloc = solve(delay_ms, bandwidth_gbps, searched, stages=S, dp=D, regions=regions,
                      compute=compute if costed else None,
                      time_budget_s=max(budget * (1 - REFINE_SHARE if refine else 1.0), 1e-9), seed=seed,
                      allow_spares=True, compression=compression)

        def _model(m: int) -> CostModel:
            return CostModel(delay_ms, bandwidth_gbps, spec_at(m).workload(S, D), compute=compute,
                             compression=compression)

        def simulated(X: np.ndarray, m: int, model: CostModel | None = None) -> float:
            return float(simulate(model or _model(m), X, micro_batches=m, engine_syncs=True,
                                  window_messages=window_messages).iteration_s)

        if refine:
            X, Z, stats = refine_by_simulation(lambda X: simulated(X, m0), alloc.matrix, alloc.spares,
                                               deadline_s=shape_t0 + budget, seed=seed)
            if stats["moves"]:
                paper = cost_model(delay_ms, bandwidth_gbps, searched, S, D, compute=compute if costed else None,
                                   compression=compression)
                alloc = replace(alloc, pipelines=tuple(tuple(int(v) for v in col) for col in X.T), spares=Z,
                                cost=paper.breakdown(X))
            alloc = replace(alloc, stats={**alloc.stats, "refined": stats})
        eff = shape_step_efficiency(compression, S, D)
        shape_best: tuple[float, int] | None = None
        for m in counts or [micro_batches]:
            model = _model(m)
            t = simulated(alloc.matrix, m, model)
            if counts:
                tried_micro.append((S, D, m, t))
            cands.append((t / eff, t, S, D, m, alloc, eff, model))
            if shape_best is None or t < shape_best[0] - 1e-12:
                shape_best = (t, m)
        assert shape_best is not None
        tried.append((S, D, shape_best[0]))
        if eff < 1.0:
            efficiency.append((S, D, eff))
        if best is None or shape_best[0] / eff < best[0] - 1e-12:
            best = (shape_best[0] / eff, alloc, shape_best[1], shape_best[0])
    if best is None:
        raise ValueError("no micro-batch count fits any shape")
    found = FastestShape(best[1], best[3], tuple(tried), best[2], tuple(tried_micro), tuple(efficiency))
    if not fit_schedules:
        return found

    # GPipe's winner first (on a tie, as GPipe chose), then the rest by GPipe time per exact step
    first = next(c for c in cands if c[5] is found.alloc and c[4] == found.micro_batches)
    order = [first] + sorted((c for c in cands if c is not first), key=lambda c: c[0])
    rows_of: list[tuple[int, int, int, float, tuple[int, ...] | None]] = []

    def fitted(i: int) -> float:
        _, _, S, D, m, alloc, eff, model = order[i]
        fit = fitted_warmups(model, alloc.matrix, m, window_messages)
        rows_of.append((S, D, m, fit.iteration_s, fit.warmups))
        return fit.iteration_s / eff

    per_exact = fit_in_order([c[0] for c in order], fitted, deadline_s=t0 + time_budget_s)
    scheduled = list(zip(per_exact, rows_of))
    win = 0  # (the first of equals: GPipe's winner, then the faster by GPipe)
    for i, (r, _) in enumerate(scheduled):
        if r < scheduled[win][0] - 1e-12:
            win = i
    if win and scheduled[win][0] > scheduled[0][0] * (1 - SCHEDULE_MARGIN):
        win = 0  # (a gain within the simulator's error: GPipe's winner stays)
    chosen = order[win]  # (the fitted ones are the order's first)
    rows = tuple(r for _, r in scheduled)
    return replace(found, alloc=chosen[5], iteration_s=chosen[1], micro_batches=chosen[4],
                   scheduled=(rows[win],) + rows[:win] + rows[win + 1:])


def fit_in_order(gpipe_s: Sequence[float], fit: Callable[[int], float], *, deadline_s: float = math.inf,
                 always: int = 1) -> list[float]:
    """Candidates' pipeline schedules fitted in the caller's order (`gpipe_s`: each one's GPipe
    time per exact step; `fit(i)`: candidate i's time per exact step under its fitted schedule),
    while the next one's GPipe time is below `SCHEDULE_GAIN_BOUND` times the best fitted so far
    (no schedule gains more), and, past the first `always`, while time.monotonic() is before
    `deadline_s`. The first is always fitted. The fitted times of the candidates fitted, a
    prefix of the order."""
    out: list[float] = []
    for i, g in enumerate(gpipe_s):
        if i and (g >= min(out) * SCHEDULE_GAIN_BOUND or (i >= always and time.monotonic() >= deadline_s)):
            break
        out.append(fit(i))
    return out


_Swap = tuple[tuple[int, int], "tuple[int, int] | int"]  # two places of X, or a place and a spare's index


def refine_by_simulation(iteration_s: Callable[[np.ndarray], float], X: np.ndarray, spares: Sequence[int], *,
                         deadline_s: float = float("inf"), max_evaluations: int = 5000, kick_swaps: int = 2,
                         seed: int = 0, reversed_start: bool = True,
                         patience: int = 3) -> tuple[np.ndarray, tuple[int, ...], dict]:
    """Iterated swap local search on `iteration_s` (the simulator's iteration time of an (S, D)
    allocation). A descent tries every swap of two placed peers in different places and of a
    placed peer with a spare, in a seeded random order, and keeps the first that lowers the time
    by more than 1e-9 relative, until a whole pass finds none (a local optimum); then the best
    allocation so far is kicked (`kick_swaps` random swaps) and descends again, until
    `patience` descents in a row found nothing better, `deadline_s` (time.monotonic()) or
    `max_evaluations`. `reversed_start`: X with its stage
    order reversed is evaluated too and the faster of the two starts (no swap reaches it, and
    on a near-symmetric network it is often as good). The best X, its spares (sorted), and
    {"evaluations", "moves" (how many times the best improved: the reversal, a descent),
    "from_s" (X's), "to_s", "descents"}."""
    rng = np.random.default_rng([seed, 2])
    X = np.array(X, dtype=np.int64)
    Z = [int(z) for z in spares]
    S, D = X.shape
    cells = [(s, d) for s in range(S) for d in range(D)]
    pairs: list[_Swap] = [(a, b) for i, a in enumerate(cells) for b in cells[i + 1:]]
    pairs += [(a, k) for a in cells for k in range(len(Z))]
    evaluations = 0

    def cost(Y: np.ndarray) -> float:
        nonlocal evaluations
        evaluations += 1
        return iteration_s(Y)

    def spent() -> bool:
        return evaluations >= max_evaluations or time.monotonic() >= deadline_s

    def swapped(X: np.ndarray, Z: list[int], pair: _Swap) -> tuple[np.ndarray, list[int]]:
        a, b = pair
        Y, W = X.copy(), Z
        if isinstance(b, int):  # a placed peer and a spare change places
            Y[a], W = Z[b], Z[:b] + [int(X[a])] + Z[b + 1:]
        else:
            Y[a], Y[b] = X[b], X[a]
        return Y, W

    def descend(X: np.ndarray, Z: list[int], t: float) -> tuple[np.ndarray, list[int], float]:
        while not spent():
            for i in rng.permutation(len(pairs)):
                if spent():
                    break
                Y, W = swapped(X, Z, pairs[i])
                u = cost(Y)
                if u < t * (1 - 1e-9):
                    X, Z, t = Y, W, u
                    break
            else:
                break  # a local optimum
        return X, Z, t

    start = cost(X)
    best = (X, Z, start)
    if reversed_start and S > 1 and not spent():
        Xr = np.ascontiguousarray(X[::-1])
        tr = cost(Xr)
        if tr < start * (1 - 1e-9):
            best = (Xr, Z, tr)
    moves = int(best[2] < start)
    descents = fruitless = 0
    cur = best
    while not spent() and pairs and fruitless < patience:
        Xd, Zd, td = descend(*cur)
        descents += 1
        fruitless += 1
        if td < best[2] * (1 - 1e-9):
            best, moves, fruitless = (Xd, Zd, td), moves + 1, 0
        if spent():
            break
        Xk, Zk = best[0], best[1]
        for _ in range(kick_swaps):
            Xk, Zk = swapped(Xk, Zk, pairs[int(rng.integers(len(pairs)))])
        cur = (Xk, Zk, cost(Xk))
    X, Z, t = best
    return X, tuple(sorted(Z)), {"evaluations": evaluations, "moves": moves, "from_s": start, "to_s": t,
                                 "descents": descents}


def _without_compute(spec: ModelSpec) -> ModelSpec:
    return replace(spec, reference_tflops=None, head_compute=False)


@dataclass(frozen=True)
class RunModel:
    """The numbers of a run's model and batch the scheduler reads (a `ModelSpec` per D)."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    global_batch_seqs: int
    micro_batches: int  # the run's M; with `auto_micro_batches`, the count the placement is searched at
    act_bytes: int = 2
    auto_micro_batches: bool = False  # the scheduler chooses M (`micro_batch_options`)

    def spec(self, dp: int, reference_tflops: float | None = None, micro_batches: int | None = None,
             update_s_per_param: float = 0.0) -> ModelSpec:
        """The model for D = `dp` pipelines: micro-batches of global / (D x M) sequences (M:
        `micro_batches`, by default the run's); with `reference_tflops` its compute is costed,
        the output head's on the last stage too, and the optimizer's update at
        `update_s_per_param`."""
        mb = self.micro_batch(dp, micro_batches)
        return ModelSpec(self.name, layers=self.layers, hidden=self.hidden, heads=self.heads, seq_len=self.seq_len,
                         vocab=self.vocab, micro_batch_size=mb, global_batch_seqs=self.global_batch_seqs,
                         act_bytes=self.act_bytes, reference_tflops=reference_tflops,
                         head_compute=reference_tflops is not None, update_s_per_param=update_s_per_param)

    def micro_batch(self, dp: int, micro_batches: int | None = None) -> int:
        """Sequences per micro-batch of D = `dp` pipelines at M = `micro_batches` (by default
        the run's): the scheduler's count."""
        return max(1, self.global_batch_seqs // (dp * (micro_batches or self.micro_batches)))

    def micro_batch_options(self, dp: int) -> tuple[int, ...]:
        """The micro-batch counts a run of D = `dp` pipelines may take: the run's own, or with
        `auto_micro_batches` every count of `micro_batch_options`."""
        if self.auto_micro_batches:
            return micro_batch_options(self.global_batch_seqs, dp)
        return (self.micro_batches,)

    def micro_batch_sizes(self, d_max: int) -> tuple[int, ...]:
        """Every micro-batch size (sequences) a shape of at most `d_max` pipelines may use."""
        return tuple(sorted({self.micro_batch(d, m) for d in range(1, max(1, d_max) + 1)
                             for m in self.micro_batch_options(d)}))

    @property
    def d_max(self) -> int:
        """The most pipelines the batch feeds: each micro-batch needs a sequence (one
        micro-batch each when the scheduler chooses M)."""
        return max(1, self.global_batch_seqs // (1 if self.auto_micro_batches else self.micro_batches))


@dataclass(frozen=True)
class ScheduleInputs:
    """What a coordinator scheduled a run's first placement on, and what it chose: the view's
    matrices (one-way ms, Gbps), each peer's compute speed relative to the median peer whose
    achieved TFLOP/s is `reference_tflops` (None: compute not costed), the run's layer's time
    per FLOP against the reference by micro-batch size (`kind`), the model, the asked shape
    (None: the scheduler's), the search's seed and budget, and the trainer's flow-control window
    (messages unacknowledged per destination, the swarm's `CommConfig.window_messages`), and for
    a compressed run the codecs the search could give its links and groups, with each peer's
    coding speed (None: exact tensors)."""

    peers: tuple[str, ...]  # peer ids, hex
    regions: tuple[str, ...]
    delay_ms: np.ndarray
    bandwidth_gbps: np.ndarray
    speeds: np.ndarray
    reference_tflops: float | None
    kind: Mapping[int, float]
    model: RunModel
    stages: int | None = None
    dp: int | None = None
    seed: int = 0
    time_budget_s: float = 5.0
    chosen: Mapping[str, object] = field(default_factory=dict)  # stages, dp, pipelines (indices), predicted, note
    window_messages: int = TRAINER_WINDOW_MESSAGES
    compression: CompressionOptions | None = None
    # The run's stages order their forwards and backwards as fitted to the links (the swarm's
    # `pipeline_schedule = "fitted"`): shapes ranked under those schedules (`solve_fastest`)
    fit_schedules: bool = False

    def tflops(self, micro_batch: int) -> float | None:
        if self.reference_tflops is None:
            return None
        return self.reference_tflops / self.kind.get(micro_batch, 1.0)

    def spec_of(self, dp: int, micro_batches: int | None = None) -> ModelSpec:
        """The model for D = `dp` pipelines at `micro_batches` (the run's by default), its compute
        at the run's layer's speed at that micro-batch size."""
        return self.model.spec(dp, self.tflops(self.model.micro_batch(dp, micro_batches)), micro_batches,
                               update_s_per_param(self.kind, self.reference_tflops))

    def shapes(self) -> list[tuple[int, int]]:
        n = len(self.peers)
        out = shape_space(n, self.model.layers, self.model.d_max, stages=self.stages, dp=self.dp,
                          compute_costed=self.reference_tflops is not None)
        if self.reference_tflops is None and self.stages is None:  # the first placement: every peer, where it can
            out = [(S, D) for S, D in out if S * D == n] or out
        return out

    def solve(self, time_budget_s: float | None = None) -> FastestShape:
        """The coordinator's search on these inputs (`choose_shape` runs it; `dtfm-sched solve
        --view` replays it), knowing the run's codecs when it compresses (`compression`)."""
        return solve_fastest(self.delay_ms, self.bandwidth_gbps, self.spec_of, self.shapes(),
                             micro_batches=self.model.micro_batches,
                             compute=self.speeds if self.reference_tflops is not None else None,
                             regions=list(self.regions) if any(self.regions) else None, seed=self.seed,
                             time_budget_s=self.time_budget_s if time_budget_s is None else time_budget_s,
                             compression=self.compression,
                             micro_options=self.model.micro_batch_options if self.model.auto_micro_batches else None,
                             window_messages=self.window_messages, fit_schedules=self.fit_schedules)

    def to_json(self) -> str:
        d = {"format": VIEW_FORMAT, "peers": list(self.peers), "regions": list(self.regions),
             "delay_ms": np.asarray(self.delay_ms).tolist(),
             "bandwidth_gbps": [[None if not np.isfinite(v) else float(v) for v in row] for row in self.bandwidth_gbps],
             "speeds": np.asarray(self.speeds).tolist(), "reference_tflops": self.reference_tflops,
             "kind": {str(b): f for b, f in sorted(self.kind.items())}, "model": asdict(self.model),
             "stages": self.stages, "dp": self.dp, "seed": self.seed, "time_budget_s": self.time_budget_s,
             "chosen": dict(self.chosen), "window_messages": self.window_messages,
             "compression": None if self.compression is None else self.compression.to_dict(),
             "pipeline_schedule": "fitted" if self.fit_schedules else "gpipe"}
        return json.dumps(d)

    @classmethod
    def read(cls, path: Path) -> "ScheduleInputs":
        """A view file; ValueError naming what is wrong with it."""
        with open(path, "rb") as f:
            raw = f.read(MAX_VIEW_BYTES + 1)
        if len(raw) > MAX_VIEW_BYTES:
            raise ValueError(f"{path}: larger than {MAX_VIEW_BYTES} bytes")
        try:
            d = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None
        if not isinstance(d, dict) or d.get("format") != VIEW_FORMAT:
            raise ValueError(f"{path}: not a dtfm view file (format {VIEW_FORMAT})")
        try:
            n = len(d["peers"])
            delay = np.array(d["delay_ms"], dtype=float)
            bw = np.array([[np.inf if v is None else v for v in row] for row in d["bandwidth_gbps"]], dtype=float)
            speeds = np.array(d["speeds"], dtype=float)
            if delay.shape != (n, n) or bw.shape != (n, n) or speeds.shape != (n,) or len(d["regions"]) != n:
                raise ValueError("the matrices, speeds and regions do not match the peers")
            ref = d["reference_tflops"]
            comp = d.get("compression")  # (a file of an exact run, or written before runs kept theirs: none)
            # (a file written before shapes were ranked under fitted schedules: GPipe's ranking)
            schedule = d.get("pipeline_schedule", "gpipe")
            if schedule not in ("fitted", "gpipe"):
                raise ValueError(f"pipeline_schedule {schedule!r} is neither 'fitted' nor 'gpipe'")
            return cls(tuple(map(str, d["peers"])), tuple(map(str, d["regions"])), delay, bw, speeds,
                       None if ref is None else float(ref), {int(b): float(f) for b, f in d["kind"].items()},
                       RunModel(**d["model"]), d["stages"], d["dp"], int(d["seed"]), float(d["time_budget_s"]),
                       dict(d.get("chosen", {})), int(d.get("window_messages", TRAINER_WINDOW_MESSAGES)),
                       None if comp is None else CompressionOptions.from_dict(comp, n), schedule == "fitted")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None
