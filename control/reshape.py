"""Re-allocation when the swarm changes: which allocation to run next, and what it costs to get there.

A pure planner (no I/O). The coordinator calls `reshape` when peers die, leave or join, or the
measured network drifts; it weighs every way of going on against the allocation in use (the
candidates and their costs: control/reshape_candidates.py): keep it, repair its holes with
spares, shrink it to its whole pipelines, grow it by pipelines of spares, reschedule the live
peers with the same stages, or restage them with another stage count. Each candidate's score is
its predicted iteration time x remaining_steps + move_s, the time its movers take to fetch the
old stages they do not hold.

The first allocation (`current=None`) is the scheduler alone, like `choose_shape`, with no moves.

Choice, with hysteresis. If the current allocation has a dead peer (or `force`), the lowest
score wins (with `force`, keep is not a choice). Otherwise keep wins unless another candidate
gains, per step, more than `min_gain` of the current iteration time AND over the remaining
steps more than its own move_s; among those, the lowest score wins. Two allocations predicted
within a few percent of each other therefore never flap back and forth on measurement noise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from dtfm.gossip import NetworkView
from dtfm.sched import SearchConfig
from dtfm.train import GPTSpec, TrainConfig

from .reshape_candidates import Range, _Cand, _current_prediction, _Planner, _same_s, _shapes
from .schedule import Shape

__all__ = ["KINDS", "Current", "ReshapePlan", "reshape"]

logger = logging.getLogger(__name__)

KINDS = ("keep", "repair", "shrink", "grow", "reschedule", "restage")  # also the tie-break order


@dataclass(frozen=True)
class Current:
    """The allocation being replaced."""

    pipelines: tuple[tuple[bytes, ...], ...]  # [d][s]: peer id
    layer_ranges: tuple[tuple[int, int], ...]  # [s]: [start, end) blocks of stage s

    def __post_init__(self) -> None:
        S = len(self.layer_ranges)
        if not self.pipelines or S < 1 or any(len(p) != S for p in self.pipelines):
            raise ValueError(f"a current allocation needs at least one pipeline, each of {S} stages "
                             "(one per layer range)")
        ids = [peer for pipe in self.pipelines for peer in pipe]
        if len(set(ids)) != len(ids):
            raise ValueError("a current allocation places a peer twice")
        ends = [0] + [b for _, b in self.layer_ranges]
        if any(a != ends[s] or b <= a for s, (a, b) in enumerate(self.layer_ranges)):
            raise ValueError(f"layer ranges {self.layer_ranges} are not contiguous from 0")

    @property
    def stages(self) -> int:
        return len(self.layer_ranges)

    @property
    def dp(self) -> int:
        return len(self.pipelines)


@dataclass(frozen=True)
class ReshapePlan:
    shape: Shape  # the allocation to run next
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
        s = self.shape
        head = (f"reshape: {self.kind} {len(s.layer_ranges)}x{len(s.pipelines)} predicted "
                f"{s.predicted_iteration_s:.3f} s, {self.moves} moves, {self.bytes_moved / 1e6:.1f} MB "
                f"in {self.move_s:.2f} s, gain {self.gain_s:.1f} s")
        if self.lost_ranges:
            head += f", lost {list(self.lost_ranges)}"
        rest = "; ".join(f"{c['kind']} {c['shape']} {c['predicted_s']:.3f}s {c['moves']}mv score {c['score']:.1f}"
                         for c in self.candidates)
        return f"{head} [{rest}]"


def reshape(view: NetworkView, spec: GPTSpec, cfg: TrainConfig, *, current: Current | None,
            live: frozenset[bytes], remaining_steps: int, stage_bytes: Callable[[Range], int] | None = None,
            regions: dict[bytes, str] | None = None, time_budget_s: float = 2.0, seed: int = 0,
            min_gain: float = 0.1, force: bool = False, stages: int | None = None, dp: int | None = None,
            config: SearchConfig | None = None) -> ReshapePlan:
    """The next allocation of the live peers of `view` (see the module docstring).

    current: the allocation in use, or None for the first (then `stages`/`dp` as choose_shape
    takes them; None: every shape). live: ids of the peers that may be placed (a peer missing
    from the view is never placed). remaining_steps: steps still to train, which a faster
    allocation saves time on. stage_bytes: bytes a peer fetches for an old stage's range
    (default `default_stage_bytes(spec)`). config: a SearchConfig for the scheduler runs
    (repeatable runs in tests), else `time_budget_s` is shared among them.
    ValueError when the view is incomplete or no allocation fits the live peers."""
    n = len(view.peers)
    if not view.complete:
        raise ValueError(f"the network view is incomplete ({view.pairs_known()} of {n * (n - 1)} links "
                         "measured): wait until gossip has measured every link")
    if remaining_steps < 0 or not 0 <= min_gain:
        raise ValueError("remaining_steps and min_gain must be non-negative")
    if current is not None and current.layer_ranges[-1][1] != spec.n_layer:
        raise ValueError(f"the current layer ranges end at {current.layer_ranges[-1][1]}, the model has "
                         f"{spec.n_layer} layers")
    pl = _Planner(view, spec, cfg, current, live, remaining_steps, stage_bytes, regions, seed, config)
    if not pl.live:
        raise ValueError("no live peer is in the network view: nothing to allocate")
    if pl.d_max < 1:
        raise ValueError(f"global batch {cfg.global_batch_seqs} is smaller than {cfg.micro_batches} "
                         "micro-batches: no pipeline can run")
    keep = None
    if current is None:
        cands = _shapes(pl, "reschedule", stages, dp, time_budget_s, None)
    else:
        cands = _same_s(pl, time_budget_s) if len(pl.live) >= current.stages else []
        if not cands:
            cands = _shapes(pl, "restage", None, None, time_budget_s, pl.cur)
        keep = next((c for c in cands if c.kind == "keep"), None)
    cands = _distinct(cands)
    if not cands:
        raise ValueError(f"no allocation fits the {len(pl.live)} live peers of the view "
                         f"(a model of {spec.n_layer} layers, at most {pl.d_max} pipelines for a global "
                         f"batch of {cfg.global_batch_seqs} in {cfg.micro_batches} micro-batches)")
    ref = keep.predicted_s if keep is not None else _current_prediction(pl)
    plan = _plan(pl, _choose(cands, keep, min_gain, remaining_steps, force), cands, ref)
    logger.info("%s", plan.summary())
    return plan


def _choose(cands: list[_Cand], keep: _Cand | None, min_gain: float, remaining_steps: int, force: bool) -> _Cand:
    """The candidate to run, with hysteresis (see the module docstring)."""
    rank = {k: i for i, k in enumerate(KINDS)}
    order = sorted(cands, key=lambda c: (c.score, rank[c.kind], c.moves))
    if keep is not None and not force:
        per_step = min_gain * keep.predicted_s
        better = [c for c in order if c is not keep and keep.predicted_s - c.predicted_s > per_step
                  and (keep.predicted_s - c.predicted_s) * remaining_steps > c.move_s]
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
    shape = Shape(tuple(tuple(ids[int(i)] for i in col) for col in c.X.T), c.ranges,
                  tuple(ids[i] for i in pl.spares(c.X)), c.predicted_s, c.objective_s)
    table = tuple({"kind": o.kind, "shape": f"{o.X.shape[0]}x{o.X.shape[1]}", "predicted_s": o.predicted_s,
                   "moves": o.moves, "bytes": o.bytes, "move_s": o.move_s, "score": o.score, "chosen": o is c}
                  for o in cands)
    return ReshapePlan(shape, c.kind, c.moves, c.bytes, c.move_s, (ref - c.predicted_s) * pl.steps, table,
                       c.fetches, c.lost)
