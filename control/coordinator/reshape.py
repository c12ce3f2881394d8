"""Re-allocation when the swarm changes: which allocation to run next, and what it costs to get
there. A pure planner (no I/O); the protocol around it is in docs/control.md.

The coordinator calls `reshape` when peers die, leave or join, or the measured network drifts.
It weighs every way of going on against the allocation in use (`current`, a `train.Plan`):

- keep: the current allocation unchanged (only while all its peers are live); new live peers
  become spares.
- repair: each dead peer replaced by a live spare, same S and D; the spare for a hole is chosen
  (one assignment over all holes) for its links to the hole's pipeline neighbours and DP group.
- shrink: same layer ranges, D reduced to the pipelines still whole, or made whole by spares:
  one candidate per count of repaired pipelines (0 moves when no spare fills a hole); the
  survivors of the dropped pipelines become spares.
- grow: live spares (joined or returned peers) form extra whole pipelines of the same S, laid
  out by the scheduler among themselves; every peer of a new pipeline moves.
- reschedule: the DT-FM scheduler on all live peers, same S, D = live // S (capped so that
  `split_batch` accepts it; and also the current D when that leaves spares), warm-started from
  the current allocation (survivors in their places, holes filled as repair does). The cost
  model does not care in which order the pipelines are listed, so the result's pipelines are
  relabelled to keep as many peers as possible in their old (stage, pipeline) place; the
  reversed stage order, as cheap on a symmetric network, is tried too, and the cheaper of the
  two (score below) is offered.
- restage: the scheduler on the live peers with every other stage count and every pipeline
  count (`shape_space`: spares allowed), layer ranges changed; when fewer than S peers are
  live, these are the only candidates. When no peer reported its compute speed, or the
  operator asked for the stage count, restage is tried only then (compute free, fewer peers or
  stages would always look faster; an asked shape is kept while the peers allow it). When the
  operator asked for the pipeline count too (`keep_dp`), only allocations of that many pipelines
  are searched while S x D peers are live (keep or repair at that count, grow to it, reschedule
  at it, the whole search budget theirs; a shrink below it and the grow back are the peers'
  doing, not the scheduler's choice).

The first allocation (`current=None`) is the scheduler alone, like `choose_shape`, with no
moves. Every candidate is costed with each peer's reported compute speed (`peer_compute`), so
a reconfiguration searches the space the first placement does: any shape, peers left out; and
each scheduler run (grow, reschedule's whole search, restage) refines its allocation on the
simulator as a first placement's is (`refine_by_simulation`; not the local repair, which stays
near the allocation in use).

Costs. A peer that takes on a layer range other than the one it holds *moves*: it fetches every
old stage that its new range needs (the blocks in it, the embeddings for a first stage, the head
for a last stage: the rule of `control.relayout.needed_stages`) and that it does not hold
itself, each stage about 16 bytes per parameter (fp32 weights, two Adam moments and the rest;
`stage_bytes` overrides it), from the live holder it reaches fastest (latency + bytes over the
view's bandwidth). A peer fetches its stages one after another, the movers in parallel, so
`move_s` is the slowest mover's total. A stage with no live holder left is *lost* (the plan
lists it; it must come from a checkpoint) and costs no fetch time here.

Each candidate's iteration time is the GPipe simulator's with the trainer's syncs and flow-control
window, on the view, as `choose_shape` predicts it; its score is predicted_iteration_s x
remaining_steps + move_s, for a compressed run with the iteration over the shape's step
efficiency (`dtfm.sched.shape_step_efficiency`: a DP codec loses steps, one pipeline has no DP
group), so candidates are weighed by time to the target loss as the first placement weighs
shapes. The run's micro-batch count is kept, unless its start left it to the scheduler
(`auto_micro_batches`): then each candidate but keep is costed at every count of
`micro_batch_options` for its D and at the run's own (where it still gives every micro-batch a
sequence), and takes the fastest (the run's own on a tie); the placement names it.

Where the run's stages take the pipeline schedule fitted to their links (`fit_schedules`), the
candidates are ranked under theirs: each is built and costed in GPipe as above, then keep and the
fastest candidates get the schedule the simulator fits to them (`dtfm.sched.fitted_warmups`), in
order of their GPipe time while it is within `SCHEDULE_GAIN_BOUND` of the best fitted one (and,
outside repeatable runs, `FIT_SHARE` of the budget), and their scores are re-costed at that;
the placement's prediction stays its GPipe figure, which the planner scales to its schedule.

Cut links (`cut_links`: pairs of peers whose link failed a step and has not been measured
healthy since) get a delay and bandwidth no working link has, so the scheduler steers around
them, and a candidate that would still exchange tensors over one (control/coordinator/links.py
`exchanges`) is predicted CUT_PENALTY_S slower per step: any candidate that avoids them wins.
The scheduler's cost model weighs only a pipeline's neighbours and DP groups, not every pair
that exchanges tensors in a step, so each candidate over a cut link also gets a *detour*: the
same layout with peers swapped (placed ones, spares) until it uses none (kind reschedule).

Choice, with hysteresis. If the current allocation has a dead peer (or `force`), the lowest
score wins (with `force`, keep is not a choice). Otherwise keep wins unless another candidate
gains, per step (compressed: per exact step's worth of progress), more than `min_gain` of the
current iteration time AND over the remaining steps more than its own move_s; among those, the
lowest score wins. Two allocations predicted within a few percent of each other therefore
never flap back and forth on measurement noise.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from dtfm.gossip import NetworkView
from dtfm.sched import (FIT_SHARE, MAX_MICRO_BATCHES, REFINE_MAX_PEERS, REFINE_SHARE, TRAINER_WINDOW_MESSAGES,
                        CompressionOptions, CostModel, ModelSpec, SearchConfig, fit_in_order, fitted_warmups,
                        layer_ranges, linear_assignment, micro_batch_options, refine_by_simulation,
                        shape_step_efficiency, simulate_iteration, solve)
from dtfm.train import GPTSpec, Plan, TrainConfig

from ..compute import peer_compute, sched_spec
from .links import used_cut_links
from .schedule import Placement, shape_space, view_matrices

__all__ = ["BYTES_PER_PARAM", "CUT_PENALTY_S", "KINDS", "Range", "ReshapePlan", "default_stage_bytes", "relabel_pipelines", "reshape"]

logger = logging.getLogger(__name__)

# fp32 weights + two fp32 Adam moments + gradient buffer: what a peer fetches per parameter.
BYTES_PER_PARAM = 16

Range = tuple[int, int]

# A cut link in the scheduler's matrices, and what a layout over one costs per step on top.
CUT_DELAY_MS = 1e6
CUT_BANDWIDTH_GBPS = 1e-6
CUT_PENALTY_S = 1e6
# With a repeatable SearchConfig (tests), a scheduler run's refinement on the simulator stops
# after this many evaluations instead of at its share of the budget.
REPEATABLE_REFINE_EVALUATIONS = 60

KINDS = ("keep", "repair", "shrink", "grow", "reschedule", "restage")  # also the tie-break order


@dataclass(frozen=True)
class ReshapePlan:
    placement: Placement  # the allocation to run next
    kind: str  # one of KINDS
    moves: int  # peers that take on a layer range other than the one they hold
    bytes_moved: int  # estimated bytes those peers fetch
    move_s: float  # estimated fetch time: each mover's stages in turn, the movers in parallel
    gain_s: float  # (current predicted iteration - new) x remaining steps; nan when the current cannot be predicted
    candidates: tuple[dict, ...]  # every candidate: kind, shape "SxD", predicted_s, moves, bytes, move_s, score
    fetches: tuple[tuple[bytes, Range, bytes | None], ...] = ()  # (mover, old stage range, source; None: lost)
    lost_ranges: tuple[Range, ...] = ()  # old stages no live peer holds: to recover from a checkpoint

    def summary(self) -> str:
        """One log line: the choice and every candidate."""
        s = self.placement
        chosen = next((c for c in self.candidates if c.get("chosen")), None)
        predicted = chosen["predicted_s"] if chosen is not None else s.predicted_iteration_s
        head = (f"reshape: {self.kind} {len(s.layer_ranges)}x{len(s.pipelines)}"
                + (f", {s.micro_batches} micro-batches" if s.micro_batches is not None else "") + " predicted "
                f"{predicted:.3f} s, {self.moves} moves, {self.bytes_moved / 1e6:.1f} MB "
                f"in {self.move_s:.2f} s, gain {self.gain_s:.1f} s")
        if self.lost_ranges:
            head += f", lost {list(self.lost_ranges)}"
        rest = "; ".join(f"{c['kind']} {c['shape']} {c['predicted_s']:.3f}s {c['moves']}mv score {c['score']:.1f}"
                         for c in self.candidates)
        return f"{head} [{rest}]"


def reshape(view: NetworkView, spec: GPTSpec, cfg: TrainConfig, *, current: Plan | None,
            live: frozenset[bytes], remaining_steps: int, stage_bytes: Callable[[Range], int] | None = None,
            regions: dict[bytes, str] | None = None, time_budget_s: float = 2.0, seed: int = 0,
            min_gain: float = 0.1, force: bool = False, stages: int | None = None, dp: int | None = None,
            config: SearchConfig | None = None, cut_links: Iterable[tuple[bytes, bytes]] = (),
            compression: CompressionOptions | None = None, keep_stages: bool = False,
            keep_dp: int | None = None, kind: Mapping[int, float] | None = None, auto_micro_batches: bool = False,
            window_messages: int = TRAINER_WINDOW_MESSAGES, fit_schedules: bool = False) -> ReshapePlan:
    """The next allocation of the live peers of `view` (see the module docstring).

    current: the allocation in use, or None for the first (then `stages`/`dp` as choose_shape
    takes them; None: every shape). live: ids of the peers that may be placed (a peer missing
    from the view is never placed). remaining_steps: steps still to train, which a faster
    allocation saves time on. stage_bytes: bytes a peer fetches for an old stage's range
    (default `default_stage_bytes(spec)`). config: a SearchConfig for the scheduler runs
    (repeatable runs in tests), else `time_budget_s` is shared among them. cut_links: pairs of
    peers whose link is cut (see the module docstring). compression: the codecs a per-link run's
    links and groups may use (each costed with its cheapest, the current allocation too; None: exact).
    keep_stages: the operator asked for the current stage count: other stage counts only when
    fewer peers than stages are live. keep_dp: the operator asked for this many pipelines:
    while the live peers fill them at the current stage count, only such allocations. kind:
    the run's layer's `kind_factors` (none: the reference rate). auto_micro_batches: the run's
    start left the micro-batch count to the scheduler (see the module docstring;
    `cfg.micro_batches` is the run's current count).
    window_messages: the swarm's flow-control window (`CommConfig.window_messages`).
    fit_schedules: candidates ranked under their fitted pipeline schedules (module docstring).
    ValueError when the view is incomplete or no allocation fits the live peers."""
    n = len(view.peers)
    if not view.complete:
        raise ValueError(f"the network view is incomplete ({view.pairs_known()} of {n * (n - 1)} links "
                         "measured): wait until gossip has measured every link")
    if remaining_steps < 0 or not 0 <= min_gain:
        raise ValueError("remaining_steps and min_gain must be non-negative")
    if current is not None and current.n_layer != spec.n_layer:
        raise ValueError(f"the current layer ranges end at {current.n_layer}, the model has {spec.n_layer} layers")
    pl = _Planner(view, spec, cfg, current, live, remaining_steps, stage_bytes, regions, seed, config,
                  frozenset(cut_links), compression, kind, auto_micro_batches, window_messages)
    if not pl.live:
        raise ValueError("no live peer is in the network view: nothing to allocate")
    if pl.d_max < 1:
        raise ValueError(f"global batch {cfg.global_batch_seqs} is smaller than {cfg.micro_batches} "
                         "micro-batches: no pipeline can run")
    keep = None
    if current is None:
        cands = _shapes(pl, "reschedule", stages, dp, time_budget_s, None)
    else:
        # Other shapes too, when compute is costed: without it a shape of fewer peers or stages
        # is predicted faster for want of a compute term, not because it is.
        same = len(pl.live) >= current.stages
        # the operator's pipeline count, while the live peers fill it: only that shape is searched
        asked = keep_dp if keep_dp is not None and 1 <= keep_dp <= pl.d_max and \
            len(pl.live) >= current.stages * keep_dp else None
        other = not same or (pl.compute.reference_tflops is not None and not keep_stages and asked is None)
        cands = _same_s(pl, time_budget_s / 2 if other else time_budget_s, asked) if same else []
        if other:
            cands += _shapes(pl, "restage", None, None, time_budget_s / 2 if same else time_budget_s, pl.cur)
        keep = next((c for c in cands if c.kind == "keep"), None)
    cands = _distinct(cands + _detours(pl, cands))
    if not cands:
        raise ValueError(f"no allocation fits the {len(pl.live)} live peers of the view "
                         f"(a model of {spec.n_layer} layers, at most {pl.d_max} pipelines for a global "
                         f"batch of {cfg.global_batch_seqs} in {cfg.micro_batches} micro-batches)")
    if fit_schedules:
        _fit_schedules(pl, cands, keep, time_budget_s * FIT_SHARE)
    ref = keep.ranked_s if keep is not None else _current_prediction(pl, fit_schedules)
    plan = _plan(pl, _choose(cands, keep, min_gain, remaining_steps, force), cands, ref)
    logger.info("%s", plan.summary())
    return plan


def _choose(cands: list[_Cand], keep: _Cand | None, min_gain: float, remaining_steps: int, force: bool) -> _Cand:
    """The candidate to run, with hysteresis (see the module docstring)."""
    rank = {k: i for i, k in enumerate(KINDS)}
    order = sorted(cands, key=lambda c: (c.score, rank[c.kind], c.moves))
    if keep is not None and not force:
        per_step = min_gain * keep.per_exact_s
        better = [c for c in order if c is not keep and keep.per_exact_s - c.per_exact_s > per_step
                  and (keep.per_exact_s - c.per_exact_s) * remaining_steps > c.move_s]
        return better[0] if better else keep
    others = [c for c in order if c is not keep]
    return others[0] if others else order[0]


def _distinct(cands: list[_Cand]) -> list[_Cand]:
    """The candidates less repeats of one allocation under one kind."""
    out, seen = [], set()
    for c in cands:
        key = (c.kind, c.X.shape, c.X.tobytes())
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _plan(pl: _Planner, c: _Cand, cands: list[_Cand], ref: float) -> ReshapePlan:
    ids = pl.ids
    placement = Placement(tuple(tuple(ids[int(i)] for i in col) for col in c.X.T), c.ranges,
                          tuple(ids[i] for i in pl.spares(c.X)), c.predicted_s, c.objective_s,
                          micro_batches=c.micro_batches if pl.auto_micro_batches else None)
    table = tuple({"kind": o.kind, "shape": f"{o.X.shape[0]}x{o.X.shape[1]}", "micro_batches": o.micro_batches,
                   "predicted_s": o.ranked_s, "pipeline_warmups": o.warmups,
                   "moves": o.moves, "bytes": o.bytes, "move_s": o.move_s, "score": o.score, "chosen": o is c}
                  for o in cands)
    return ReshapePlan(placement, c.kind, c.moves, c.bytes, c.move_s, (ref - c.ranked_s) * pl.steps, table,
                       c.fetches, c.lost)


# ---------------------------------------------------------------------- candidates and costs


def default_stage_bytes(spec: GPTSpec) -> Callable[[Range], int]:
    """Bytes of a stage's state: BYTES_PER_PARAM per parameter of its blocks, plus the embeddings
    on the first stage and the final norm and head (or tied embedding copy) on the last."""
    def stage_bytes(r: Range) -> int:
        a, b = r
        params = (b - a) * spec.layer_params
        if a == 0:
            params += (spec.vocab + spec.seq_len) * spec.n_embd
        if b == spec.n_layer:
            params += spec.vocab * spec.n_embd + (2 if spec.bias else 1) * spec.n_embd
        return BYTES_PER_PARAM * params
    return stage_bytes


def relabel_pipelines(X: np.ndarray, old: np.ndarray) -> np.ndarray:
    """X's pipelines (columns of an (S, D) array) reordered so that as many cells as possible
    hold the peer that `old` ((S, D0), -1 for none) has there; pipelines without a match go last.
    The cost model and the simulator do not depend on the order of pipelines."""
    D, D0 = X.shape[1], old.shape[1]
    same = (X[:, :, None] == old[:, None, :]) & (old[:, None, :] >= 0)
    rows, cols = linear_assignment(same.sum(axis=0), maximize=True)
    target = {int(r): int(c) for r, c in zip(rows, cols)}
    order = sorted(range(D), key=lambda i: (target.get(i, D0 + i), i))
    return X[:, order]


def _better(a: _Cand, b: _Cand) -> bool:
    """a scores lower than b, or as low (to rounding) with fewer moves."""
    tol = 1e-9 * max(1.0, abs(b.score))
    return a.score < b.score - tol or (a.score <= b.score + tol and a.moves < b.moves)


@dataclass
class _Cand:
    kind: str
    X: np.ndarray  # (S, D) view indices
    ranges: tuple[Range, ...]
    predicted_s: float = 0.0
    per_exact_s: float = 0.0  # predicted_s over the shape's step efficiency (compressed runs; else the same)
    objective_s: float = 0.0
    moves: int = 0
    bytes: int = 0
    move_s: float = 0.0
    score: float = 0.0
    fetches: tuple = ()
    lost: tuple = ()
    micro_batches: int = 0  # the count it is predicted at
    # Its iteration under the pipeline schedule fitted to it, and that schedule's warm-ups (None:
    # GPipe), where one was fitted (`_fit_schedules`); else None, and GPipe's `predicted_s` ranks it.
    scheduled_s: float | None = None
    warmups: tuple[int, ...] | None = None

    @property
    def ranked_s(self) -> float:
        """The iteration it is ranked by: under its fitted schedule where one was fitted."""
        return self.predicted_s if self.scheduled_s is None else self.scheduled_s


class _Planner:
    """The live peers of a view and the allocation in use: builds and costs the candidates."""

    def __init__(self, view, spec, cfg, current, live, remaining_steps, stage_bytes, regions, seed, config,
                 cut=frozenset(), compression: CompressionOptions | None = None,
                 kind: Mapping[int, float] | None = None, auto_micro_batches: bool = False,
                 window_messages: int = TRAINER_WINDOW_MESSAGES):
        self.view, self.spec, self.cfg = view, spec, cfg
        self.auto_micro_batches, self.window = auto_micro_batches, window_messages
        self.compression = compression
        self.ids = view.peers
        self.index = {p: i for i, p in enumerate(self.ids)}
        self.live = [i for i, p in enumerate(self.ids) if p in live]
        self.live_set = set(self.live)
        self.delay, self.bw = view_matrices(view)
        self.cut = frozenset((a, b) for a, b in cut if a in self.index and b in self.index)
        for a, b in self.cut:
            i, j = self.index[a], self.index[b]
            self.delay[i, j] = self.delay[j, i] = CUT_DELAY_MS
            self.bw[i, j] = self.bw[j, i] = CUT_BANDWIDTH_GBPS
        self.steps = remaining_steps
        self.stage_bytes = stage_bytes or default_stage_bytes(spec)
        self.regions = regions
        self.seed, self.config = seed, config
        # split_batch: every micro-batch a sample (one micro-batch each when the count is the scheduler's)
        self.d_max = cfg.global_batch_seqs // (1 if auto_micro_batches else cfg.micro_batches)
        self.compute = peer_compute(view, kind)  # each peer's speed, as it reported it
        self.current = current
        self._models: dict[tuple[int, int, int], CostModel] = {}
        if current is not None:
            # (S, D) view indices of the current allocation; -1 where the peer is dead or unknown
            self.cur = np.array([[self.index[p] if p in self.index and self.index[p] in self.live_set else -1
                                  for p in pipe] for pipe in current.pipelines], dtype=np.int64).T
            self.old_ranges = tuple(current.layer_ranges)
            self.held = {int(i): s for s, row in enumerate(self.cur) for i in row if i >= 0}

    # -- evaluation -----------------------------------------------------------------------
    def model(self, S: int, D: int, M: int | None = None) -> CostModel:
        """The cost model of S x D at M micro-batches (the run's by default)."""
        M = M or self.cfg.micro_batches
        m = self._models.get((S, D, M))
        if m is None:
            m = CostModel(self.delay, self.bw, self.mspec(D, M).workload(S, D), compute=self.compute.speeds,
                          compression=self.compression)
            self._models[(S, D, M)] = m
        return m

    def mspec(self, D: int, M: int | None = None) -> ModelSpec:
        """The scheduler's model for D pipelines at M micro-batches (the run's by default), its
        compute costed at the peers' speeds."""
        cfg = self.cfg if M is None or M == self.cfg.micro_batches else replace(self.cfg, micro_batches=M)
        return self.compute.spec(self.spec, cfg, D)

    def micro_counts(self, kind: str, D: int) -> list[int]:
        """The micro-batch counts a candidate of D pipelines is costed at: the run's, and where the
        scheduler chooses the count (not for keep), every count of `micro_batch_options`."""
        own = self.cfg.micro_batches
        if not self.auto_micro_batches or kind == "keep":
            return [own]
        fits = D * own <= self.cfg.global_batch_seqs and own <= MAX_MICRO_BATCHES
        return ([own] if fits else []) + [m for m in micro_batch_options(self.cfg.global_batch_seqs, D) if m != own]

    def evaluate(self, kind: str, X: np.ndarray, ranges) -> _Cand:
        S, D = X.shape
        c = _Cand(kind, X, tuple(ranges))
        best: tuple[float, int] | None = None
        for M in self.micro_counts(kind, D):  # (the run's first: it wins a tie)
            t = self.iteration_s(X, M)
            if best is None or t < best[0] - 1e-12:
                best = (t, M)
        assert best is not None
        c.predicted_s, c.micro_batches = best
        m = self.model(S, D, c.micro_batches)
        c.objective_s = float(m.breakdown(X).paper_s)
        self._moves(c)
        c.per_exact_s = c.predicted_s / shape_step_efficiency(self.compression, S, D)
        c.score = c.per_exact_s * self.steps + c.move_s
        return c

    def _moves(self, c: _Cand) -> None:
        if self.current is None:
            return  # the first allocation: every stage starts from the seed, nothing to fetch
        old, n_layer = self.old_ranges, self.spec.n_layer
        fetches, lost, moves, total, slowest = [], set(), 0, 0, 0.0
        for s, row in enumerate(c.X):
            a, b = c.ranges[s]
            for i in map(int, row):
                mine = self.held.get(i)
                if mine is not None and old[mine] == (a, b):
                    continue
                moves += 1
                need = {k for k, (oa, ob) in enumerate(old) if oa < b and a < ob}
                need |= ({0} if a == 0 else set()) | ({len(old) - 1} if b == n_layer else set())
                t = 0.0
                for k in sorted(need - {mine}):
                    size = int(self.stage_bytes(old[k]))
                    total += size
                    holders = [int(h) for h in self.cur[k] if h >= 0]
                    if not holders:
                        lost.add(old[k])
                        fetches.append((self.ids[i], old[k], None))
                        continue
                    secs = [self.delay[h, i] / 1e3 + size * 8 / (self.bw[h, i] * 1e9) for h in holders]
                    j = int(np.argmin(secs))
                    t += secs[j]
                    fetches.append((self.ids[i], old[k], self.ids[holders[j]]))
                slowest = max(slowest, t)
        c.moves, c.bytes, c.move_s = moves, total, float(slowest)
        c.fetches, c.lost = tuple(fetches), tuple(sorted(lost))

    # -- filling holes --------------------------------------------------------------------
    def fill(self, X: np.ndarray, pool: Sequence[int]) -> np.ndarray | None:
        """X with its -1 cells filled from `pool`, stage by stage, each stage's holes assigned at
        once for the least sum of hops to the pipeline's neighbours and DP costs to the group."""
        X = X.copy()
        S, D = X.shape
        pool = [int(p) for p in pool]
        if int((X < 0).sum()) > len(pool):
            return None
        m = self.model(S, D)
        grad = m.uniform_grad_gb()
        for s in range(S):
            holes = np.flatnonzero(X[s] < 0)
            if not len(holes):
                continue
            cand = np.array(pool, dtype=np.int64)
            cost = np.zeros((len(holes), len(cand)))
            group = X[s][X[s] >= 0]
            if len(group):
                dp = (m.dp_a + grad * m.dp_b)[np.ix_(cand, group)] + (m.dp_a + grad * m.dp_b)[np.ix_(group, cand)].T
                cost += dp.sum(axis=1)[None, :]
            for h, p in enumerate(holes):
                if s > 0 and X[s - 1, p] >= 0:
                    cost[h] += 2 * m.hop[X[s - 1, p], cand]
                if s < S - 1 and X[s + 1, p] >= 0:
                    cost[h] += 2 * m.hop[cand, X[s + 1, p]]
            rows, cols = linear_assignment(cost)
            for r, k in zip(rows, cols):
                X[s, holes[r]] = cand[k]
            taken = {int(cand[k]) for k in cols}
            pool = [p for p in pool if p not in taken]
        return X

    def cut_in_use(self, X: np.ndarray) -> int:
        return len(used_cut_links([[self.ids[int(i)] for i in col] for col in X.T], self.cut))

    def avoid_cut(self, X: np.ndarray) -> np.ndarray | None:
        """X with swaps (see `_detours`) until no cut link is in use; None if none get there."""
        S, D = X.shape
        m = self.model(S, D)
        X = X.copy()
        left = self.cut_in_use(X)
        for _ in range(S * D):
            if left == 0:
                return X
            best: tuple[float, np.ndarray, int] | None = None
            ends = {self.index[p] for link in used_cut_links([[self.ids[int(i)] for i in col] for col in X.T],
                                                             self.cut) for p in link}
            for (s, d), x in np.ndenumerate(X):
                if int(x) not in ends:
                    continue
                for y in [int(v) for v in X.ravel()] + self.spares(X):
                    if y == int(x):
                        continue
                    Y = X.copy()
                    where = np.argwhere(X == y)
                    Y[s, d] = y
                    if len(where):
                        Y[tuple(where[0])] = x
                    n = self.cut_in_use(Y)
                    if n < left:
                        cost = float(m.total(Y))
                        if best is None or (n, cost) < (best[2], best[0]):
                            best = (cost, Y, n)
            if best is None:
                return None
            X, left = best[1], best[2]
        return X if left == 0 else None

    def spares(self, X: np.ndarray) -> list[int]:
        used = set(map(int, X.ravel()))
        return [i for i in self.live if i not in used]

    # -- the scheduler on a subset of peers ------------------------------------------------
    def schedule(self, peers: Sequence[int], S: int, D: int, budget_s: float, initial=None,
                 local: bool = False) -> np.ndarray:
        """The scheduler on `peers` (view indices) for S x D, warm-started from `initial` ((S, D)
        view indices); `local`: only polish `initial` (swaps and re-matching, no evolution).
        Otherwise the search's allocation is refined on the simulator (`refine_by_simulation`,
        `REFINE_SHARE` of the budget, up to `REFINE_MAX_PEERS` peers), as a first placement's is;
        with a repeatable `config` (its generations fixed) by a fixed number of evaluations."""
        t0 = time.monotonic()
        peers = list(peers)
        refine = not local and len(peers) <= REFINE_MAX_PEERS and S * D > 1
        sub = np.ix_(peers, peers)
        labels = [self.regions.get(self.ids[i], "") for i in peers] if self.regions else None
        cfg = self.config or SearchConfig(time_budget_s=max(budget_s * (1 - REFINE_SHARE if refine else 1.0), 1e-3))
        if local:
            cfg = replace(cfg, generations=0, warm_only=True)
        pos = {p: k for k, p in enumerate(peers)}
        init = None if initial is None else [[pos[int(v)] for v in col] for col in initial.T]
        flat = len(peers) < cfg.hierarchy_min_peers  # (the hierarchical search costs no compute)
        costed = flat and self.compute.reference_tflops is not None
        alloc = solve(self.delay[sub], self.bw[sub], self.mspec(D) if costed else sched_spec(self.spec, self.cfg, D),
                      stages=S, dp=D, compute=self.compute.speeds[peers] if costed else None,
                      regions=labels, seed=self.seed, config=cfg, initial=init,
                      compression=None if self.compression is None else self.compression.of_peers(peers))
        X = np.array(peers, dtype=np.int64)[alloc.matrix]
        if not refine:
            return X
        placed = set(map(int, X.ravel()))
        repeatable = self.config is not None and self.config.generations is not None
        limit = {"max_evaluations": REPEATABLE_REFINE_EVALUATIONS} if repeatable else {"deadline_s": t0 + budget_s}
        X, _, _ = refine_by_simulation(self.iteration_s, X, [p for p in peers if p not in placed], seed=self.seed,
                                       **limit)
        return X

    def iteration_s(self, X: np.ndarray, M: int | None = None) -> float:
        """The simulated iteration of X ((S, D) view indices) at M micro-batches (the run's by
        default), a layout over a cut link penalised by CUT_PENALTY_S."""
        S, D = X.shape
        M = M or self.cfg.micro_batches
        t = float(simulate_iteration(self.model(S, D, M), X, micro_batches=M, engine_syncs=True,
                                     window_messages=self.window).iteration_s)
        if self.cut and used_cut_links([[self.ids[int(i)] for i in col] for col in X.T], self.cut):
            t += CUT_PENALTY_S
        return t

    def oriented(self, kind: str, X: np.ndarray, ranges, old: np.ndarray | None) -> _Cand:
        """The best (by score) of X, X with its stage order reversed, and each with fewer moves
        where that costs nothing (`fewer_moves`), pipelines relabelled towards `old`."""
        options = [X] if X.shape[0] == 1 else [X, X[::-1]]
        towards = old if old is not None and old.shape[0] == X.shape[0] else None
        if towards is not None:
            options += [self.fewer_moves(Y) for Y in options]
            options = [relabel_pipelines(Y, towards) for Y in options]
        found = [self.evaluate(kind, np.ascontiguousarray(Y), ranges) for Y in options]
        best = found[0]
        for c in found[1:]:
            if _better(c, best):
                best = c
        return best

    def fewer_moves(self, X: np.ndarray) -> np.ndarray:
        """X with peers put back on the stage they hold, by swaps (with a placed peer or a spare)
        that do not raise the cost model's objective: the scheduler breaks ties between equally
        cheap layouts (peers of one site, interchangeable) blind to where the weights are."""
        S, D = X.shape
        m = self.model(S, D)
        X = X.copy()
        spares = self.spares(X)
        bound = m.total(X) * (1 + 1e-9) + 1e-12
        old = {i: s for i, s in self.held.items()}
        for _ in range(S * D):
            done = True
            for s, p in np.argwhere(np.ones_like(X, dtype=bool)):
                x = int(X[s, p])
                if old.get(x) == s:
                    continue
                where = {int(v): (t, q) for (t, q), v in np.ndenumerate(X)}
                for y in [y for y, h in old.items() if h == s]:
                    t, q = where.get(y, (None, None))
                    if t == s or (t is None and y not in spares):
                        continue
                    Y = X.copy()  # y back on its stage: one move fewer, whatever x's fate
                    Y[s, p] = y
                    if t is not None:
                        Y[t, q] = x
                    if m.total(Y) <= bound:
                        X = Y
                        if t is None:
                            spares = [z for z in spares if z != y] + [x]
                        done = False
                        break
            if done:
                break
        return X


def _same_s(pl: _Planner, budget_s: float, dp: int | None = None) -> list[_Cand]:
    """keep, repair, shrink, grow and reschedule: every candidate with the current stages; with
    `dp` (the operator's pipeline count, which the live peers fill) only those of dp pipelines."""
    cur, ranges = pl.cur, pl.old_ranges
    S, D = cur.shape
    holes = cur < 0
    spares = pl.spares(cur)
    grow_max = 0 if holes.any() else min(len(spares) // S, pl.d_max - D)
    grows = list(range(1, grow_max + 1)) if dp is None else [g for g in (dp - D,) if 1 <= g <= grow_max]
    # reschedule at D = live // S (capped), and at the current D too when spares would be left
    widths = [dp] if dp is not None else \
        sorted({w for w in (min(len(pl.live) // S, pl.d_max), min(D, len(pl.live) // S)) if w >= 1})
    share = budget_s / (len(grows) + 2 * len(widths))
    out = [pl.evaluate("keep", cur, ranges)] if not holes.any() else _mend(pl, holes, spares)
    if dp is not None:
        out = [c for c in out if c.X.shape[1] == dp]
    for g in grows:  # spares form g new pipelines, laid out among themselves
        Xg = pl.schedule(spares, S, g, share)
        both = [pl.evaluate("grow", np.hstack([cur, Y]), ranges) for Y in ([Xg] if S == 1 else [Xg, Xg[::-1]])]
        out.append(min(both, key=lambda c: c.score))
    for D2 in widths:  # warm start: the pipelines with fewest holes, holes and new pipelines filled
        keep_cols = sorted(sorted(range(D), key=lambda p: (int(holes[:, p].sum()), p))[:D2])
        X0 = np.full((S, D2), -1, dtype=np.int64)
        X0[:, :len(keep_cols)] = cur[:, keep_cols]
        warm = pl.fill(X0, [i for i in pl.live if i not in set(map(int, X0[X0 >= 0]))])
        for local in (False, True):  # the whole search, and a local repair that stays near the warm start
            Xs = pl.schedule(pl.live, S, D2, share, initial=warm, local=local)
            out.append(pl.oriented("reschedule", Xs, ranges, cur))
    return out


def _mend(pl: _Planner, holes: np.ndarray, spares: list[int]) -> list[_Cand]:
    """repair (every hole filled by a spare) and shrink (the whole pipelines, plus the r easiest
    to repair, for every r that the spares allow)."""
    cur, ranges = pl.cur, pl.old_ranges
    D = cur.shape[1]
    out = []
    repaired = pl.fill(cur, spares) if int(holes.sum()) <= len(spares) and D <= pl.d_max else None
    if repaired is not None:
        out.append(pl.evaluate("repair", repaired, ranges))
    whole = [p for p in range(D) if not holes[:, p].any()]
    broken = sorted((p for p in range(D) if holes[:, p].any()), key=lambda p: (int(holes[:, p].sum()), p))
    for r in range(len(broken)):
        cols = sorted(whole + broken[:r])
        if not cols or int(holes[:, broken[:r]].sum()) > len(spares) or len(cols) > pl.d_max:
            continue
        X = cur[:, cols]
        pool = [i for i in pl.live if i not in set(map(int, X[X >= 0]))]  # the dropped survivors are spares too
        shrunk = pl.fill(X, pool)
        if shrunk is not None:
            out.append(pl.evaluate("shrink", shrunk, ranges))
    return out


def _detours(pl: _Planner, cands: list[_Cand]) -> list[_Cand]:
    """For each candidate over a cut link, the same layout with peers swapped (among the placed
    and the spares) until it uses none, each swap the cheapest by the cost model that leaves
    fewer cut links in use: the scheduler sees only the links its cost model weighs (a
    pipeline's neighbours, a DP group), not every pair that exchanges tensors in a step."""
    if not pl.cut:
        return []
    out = []
    for c in cands:
        X = pl.avoid_cut(c.X)
        if X is not None and not np.array_equal(X, c.X):
            out.append(pl.evaluate("reschedule", X, c.ranges))
    return out


def _shapes(pl: _Planner, kind: str, stages, dp, budget_s: float, old: np.ndarray | None) -> list[_Cand]:
    """The scheduler on the live peers for each allowed shape (stages None: every shape; stages
    without dp: every count of pipelines the peers form, when compute is costed, else the most)."""
    # (the operator's stage count may split the layers unevenly; the scheduler's own choices do not)
    shapes = shape_space(len(pl.live), pl.spec, pl.cfg, stages=stages, dp=dp,
                         compute_costed=pl.compute.reference_tflops is not None,
                         auto_micro_batches=pl.auto_micro_batches, even_layers=stages is None)
    if stages is None and old is not None:
        shapes = [(S, D) for S, D in shapes if S != old.shape[0]]
    out = []
    for S, D in shapes:
        X = pl.schedule(pl.live, S, D, budget_s / len(shapes))
        out.append(pl.oriented(kind, X, tuple(layer_ranges(pl.spec.n_layer, S)), old))
    return out


def _current_prediction(pl: _Planner, fit_schedules: bool = False) -> float:
    """The current allocation's predicted iteration on the view (under its fitted schedule with
    `fit_schedules`), nan when a peer left the view."""
    if pl.current is None or any(p not in pl.index for pipe in pl.current.pipelines for p in pipe):
        return float("nan")
    X = np.array([[pl.index[p] for p in pipe] for pipe in pl.current.pipelines], dtype=np.int64).T
    m = pl.model(*X.shape)
    if fit_schedules:
        return fitted_warmups(m, X, pl.cfg.micro_batches, pl.window).iteration_s
    return float(simulate_iteration(m, X, micro_batches=pl.cfg.micro_batches, engine_syncs=True,
                                    window_messages=pl.window).iteration_s)


def _fit_schedules(pl: _Planner, cands: list[_Cand], keep: _Cand | None, budget_s: float) -> None:
    """Keep and the fastest candidates re-costed under the pipeline schedule fitted to each (see
    the module docstring): their `scheduled_s`, `warmups`, `per_exact_s` and `score`."""
    repeatable = pl.config is not None and pl.config.generations is not None
    order = ([keep] if keep is not None else []) + sorted((c for c in cands if c is not keep),
                                                          key=lambda c: c.per_exact_s)

    def fit(i: int) -> float:
        c = order[i]
        S, D = c.X.shape
        fit = fitted_warmups(pl.model(S, D, c.micro_batches), c.X, c.micro_batches, pl.window)
        c.scheduled_s = fit.iteration_s + (c.predicted_s - fit.gpipe_s)  # (a cut link's penalty kept)
        c.warmups = fit.warmups
        c.per_exact_s = c.scheduled_s / shape_step_efficiency(pl.compression, S, D)
        c.score = c.per_exact_s * pl.steps + c.move_s
        return c.per_exact_s

    fit_in_order([c.per_exact_s for c in order], fit, always=2,
                 deadline_s=math.inf if repeatable else time.monotonic() + budget_s)
