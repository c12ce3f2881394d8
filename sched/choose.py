"""Which pipeline links and DP groups of an allocation compress, and why.

`choose_compression(model, X)` picks a codec per pipeline link (stage s -> s+1 of pipeline p)
and per DP group (stage s) from the model's `CompressionOptions`, judged by the iteration
simulator, so a link whose transfers hide behind the compute they overlap stays exact and a
slow one compresses. Deterministic:

1. every global choice (one pipeline codec everywhere, one DP codec everywhere) is simulated;
2. from two starts, all exact and the best global choice, a descent: for each boundary, the
   assignments "every link of this boundary takes its least lossy codec whose link time is at
   most T", for every threshold T among the links' times; for each group, each codec; a move
   is taken when it shortens the predicted iteration, or keeps it and is less lossy;
3. a clean-up: each link and group goes back to a less lossy codec (exact first) whenever that
   costs no predicted time;
4. the lower of the two results (on a tie the less lossy).

With `min_saving_fraction` > 0 a more lossy move must also save that share of the exact
iteration (the result may then be up to that share slower than the best global choice).
By default the result is never predicted slower than the best global choice, and every codec other
than exact in it saves predicted time on its own (`saving_s`: the plan with that link or
group exact, minus the plan). Options are ordered least lossy first (exact, int8, int4;
exact, diloco, cocktail: the measured loss gaps), which decides ties.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .compression import CodecAssignment, DataParallelCodec, PipelineCodec, step_efficiency
from .cost import CostModel
from .simulate import simulate

__all__ = ["ChoiceReason", "CompressionPlan", "GroupChoice", "LinkChoice", "choose_compression"]

_REL_TOL = 1e-9  # predicted times this close (relative) are a tie
_MAX_SWEEPS = 8


class ChoiceReason(enum.Enum):
    SLOW = "slow"  # compressed: the link or group is on the critical path and coding pays
    HIDDEN = "hidden"  # exact: its transfers take less than the compute they overlap
    OFF_CRITICAL_PATH = "off-critical-path"  # exact: faster alone, but another link or group bounds the iteration
    CODING_TOO_SLOW = "coding-too-slow"  # exact: no codec makes it faster once coding is counted
    NO_OPTIONS = "no-options"  # exact: no codec allowed on this axis
    NO_GROUP = "no-group"  # exact: one pipeline, nothing to synchronise
    STEP_EFFICIENCY = "step-efficiency"  # exact: faster per step, but the steps it loses cost more time
    WITHIN_ERROR = "within-error"  # compressed: exact would save no more than the predictor's error


@dataclass(frozen=True)
class LinkChoice:
    stage: int  # the link from stage `stage` to stage + 1
    pipeline: int
    src: int  # peer index of stage `stage` in this pipeline
    dst: int
    codec: PipelineCodec
    exact_link_s: float  # one micro-batch, one direction, exact: latency + transfer
    link_s: float  # the same with the chosen codec, coding included
    overlap_compute_s: float  # forward compute per micro-batch of the slower of its two stages
    saving_s: float  # predicted iteration seconds this codec saves (the plan with this link exact, minus the plan)
    reason: ChoiceReason

    def to_dict(self) -> dict:
        return {"stage": self.stage, "pipeline": self.pipeline, "src": self.src, "dst": self.dst,
                "codec": self.codec.name, "exact_link_s": self.exact_link_s, "link_s": self.link_s,
                "overlap_compute_s": self.overlap_compute_s, "saving_s": self.saving_s, "reason": self.reason.value}


@dataclass(frozen=True)
class GroupChoice:
    stage: int
    peers: tuple[int, ...]
    codec: DataParallelCodec
    exact_sync_s: float  # one exact synchronisation (the paper's DP cost of the group)
    sync_s: float  # one synchronisation with the chosen codec, coding included
    sync_every: int  # steps per synchronisation
    saving_s: float  # predicted iteration seconds this codec saves
    reason: ChoiceReason

    def to_dict(self) -> dict:
        return {"stage": self.stage, "peers": list(self.peers), "codec": self.codec.name,
                "exact_sync_s": self.exact_sync_s, "sync_s": self.sync_s, "sync_every": self.sync_every,
                "saving_s": self.saving_s, "reason": self.reason.value}


@dataclass(frozen=True)
class CompressionPlan:
    """A codec per link and group of one allocation, with the simulator's reasons."""

    assignment: CodecAssignment
    links: tuple[LinkChoice, ...]  # by stage, then pipeline
    groups: tuple[GroupChoice, ...]  # by stage
    iteration_s: float  # predicted, with this plan
    exact_iteration_s: float  # predicted, nothing compressed
    best_global: tuple[str, str]  # the best single (pipeline, DP) codec pair, by name
    best_global_iteration_s: float

    @property
    def compressed(self) -> bool:
        return not self.assignment.exact

    def to_dict(self) -> dict:
        return {"iteration_s": self.iteration_s, "exact_iteration_s": self.exact_iteration_s,
                "best_global": {"pp": self.best_global[0], "dp": self.best_global[1],
                                "iteration_s": self.best_global_iteration_s},
                "links": [c.to_dict() for c in self.links], "groups": [g.to_dict() for g in self.groups],
                "assignment": self.assignment.to_dict()}


class _Judge:
    """Predicted iteration times and objectives of codec index arrays, memoised, and which of two
    plans is better.

    By iteration time (`efficiency` None): a plan that compresses more must be shorter by
    `margin` seconds; on a tie the less lossy wins (lossiness: the sum of codec indices, least
    lossy first). By time to a target loss (`efficiency` a step-efficiency table): the objective
    is iteration time / `step_efficiency`, and a plan that leaves more links or groups exact must
    have an objective lower by more than `error_fraction` of the other's; on a tie the one that
    compresses more wins (lossiness: the count of links and groups not exact)."""

    def __init__(self, model: CostModel, X: np.ndarray, sim_kw: dict, margin: float = 0.0,
                 efficiency: Mapping[str, float] | None = None, error_fraction: float = 0.0) -> None:
        self.m, self.X, self.kw = model, X, sim_kw
        self.margin = margin  # seconds a more lossy codec must save (by iteration time)
        self.efficiency, self.error_fraction = efficiency, error_fraction
        self.pp, self.dp = model.options.pp, model.options.dp
        self.memo: dict[tuple[bytes, bytes], float] = {}

    @property
    def to_loss(self) -> bool:
        return self.efficiency is not None

    def assignment(self, pp: np.ndarray, dp: np.ndarray) -> CodecAssignment:
        return CodecAssignment(tuple(tuple(self.pp[k] for k in row) for row in pp), tuple(self.dp[k] for k in dp))

    def time(self, pp: np.ndarray, dp: np.ndarray) -> float:
        key = (pp.tobytes(), dp.tobytes())
        if key not in self.memo:
            self.memo[key] = simulate(self.m, self.X, codecs=self.assignment(pp, dp), **self.kw).iteration_s
        return self.memo[key]

    def objective(self, pp: np.ndarray, dp: np.ndarray) -> float:
        t = self.time(pp, dp)
        if self.efficiency is None:
            return t
        return t / step_efficiency(self.assignment(pp, dp), self.efficiency)

    def lossiness(self, pp: np.ndarray, dp: np.ndarray) -> int:
        if self.to_loss:
            return int(np.count_nonzero(pp) + np.count_nonzero(dp))
        return int(pp.sum() + dp.sum())

    def score(self, pp: np.ndarray, dp: np.ndarray) -> tuple[float, int]:
        return self.objective(pp, dp), self.lossiness(pp, dp)

    def better(self, t: float, loss: int, t_ref: float, loss_ref: int) -> bool:
        """(t, loss) beats (t_ref, loss_ref): see the class's docstring."""
        tol = _REL_TOL * max(1.0, abs(t_ref))
        if self.to_loss:
            if loss < loss_ref:
                return t < t_ref - max(tol, self.error_fraction * t_ref)
            return t < t_ref - tol or (t <= t_ref + tol and loss > loss_ref)
        if loss > loss_ref:
            return t < t_ref - max(tol, self.margin)
        return t < t_ref - tol or (t <= t_ref + tol and loss < loss_ref)


def _link_times(model: CostModel, X: np.ndarray) -> np.ndarray:
    """(S-1, D, C) one micro-batch's latency + transfer + coding on each link with each codec."""
    wl = model.workload
    m, _ = model.pp_messages()
    vol = wl.act_gb / m
    base_lat = model.lat_s[X[:-1], X[1:]]
    per_gb = model.sim_s_per_gb[X[:-1], X[1:]]
    out = []
    for c in model.options.pp:
        enc, dec = model.peer_pp_coding_s(c)  # forward: the sender encodes, the receiver decodes
        out.append(base_lat + per_gb * vol * model.pp_ratio(c) + enc[X[:-1]] + dec[X[1:]])
    return np.stack(out, axis=-1)


def _descend(judge: _Judge, T: np.ndarray, pp: np.ndarray, dp: np.ndarray, groups: bool) -> tuple[np.ndarray, np.ndarray]:
    S1, D, C = T.shape
    t_cur, loss_cur = judge.score(pp, dp)
    for _ in range(_MAX_SWEEPS):
        moved = False
        for s in range(S1):
            if C == 1:
                break
            best = None
            for thr in sorted(set(T[s].ravel().tolist()), reverse=True):
                ok = T[s] <= thr * (1 + 1e-12)
                row = np.where(ok.any(axis=1), ok.argmax(axis=1), T[s].argmin(axis=1))
                cand = pp.copy()
                cand[s] = row
                t, loss = judge.score(cand, dp)
                if best is None or judge.better(t, loss, best[0], best[1]):
                    best = (t, loss, cand)
            if best is not None and judge.better(best[0], best[1], t_cur, loss_cur):
                t_cur, loss_cur, pp = best
                moved = True
        for s in range(len(dp) if groups else 0):
            for k in range(len(judge.dp)):
                cand = dp.copy()
                cand[s] = k
                t, loss = judge.score(pp, cand)
                if judge.better(t, loss, t_cur, loss_cur):
                    t_cur, loss_cur, dp = t, loss, cand
                    moved = True
        if not moved:
            break
    return _clean_up(judge, pp, dp, groups) if judge.to_loss else _clean_up_exact(judge, pp, dp)


def _with(a: np.ndarray, i: int, k: int) -> np.ndarray:
    """A copy of `a` with a[i] = k."""
    out = a.copy()
    out[i] = k
    return out


def _clean_up_exact(judge: _Judge, pp: np.ndarray, dp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every link and group back to a less lossy codec wherever that costs no predicted time."""
    t_ref = judge.time(pp, dp)
    tol = _REL_TOL * max(1.0, abs(t_ref))
    for _ in range(_MAX_SWEEPS):
        moved = False
        for s, p in np.ndindex(*pp.shape):
            for k in range(pp[s, p]):
                cand = pp.copy()
                cand[s, p] = k
                if judge.time(cand, dp) <= t_ref + tol:
                    pp, moved = cand, True
                    break
        for s in range(len(dp)):
            for k in range(dp[s]):
                cand = dp.copy()
                cand[s] = k
                if judge.time(pp, cand) <= t_ref + tol:
                    dp, moved = cand, True
                    break
        if not moved:
            break
    return pp, dp


def _clean_up(judge: _Judge, pp: np.ndarray, dp: np.ndarray, groups: bool) -> tuple[np.ndarray, np.ndarray]:
    """By time to loss: every exact link and group takes a codec wherever leaving it exact does
    not save more than the predictor's error. The objective is held within that error of the
    descent's result as a whole (not link by link), so links that each save less than the error
    cannot together cost more than it."""
    bound = judge.objective(pp, dp) * (1 + judge.error_fraction)
    for _ in range(_MAX_SWEEPS):
        moved = False
        for s, p in np.ndindex(*pp.shape):
            if pp[s, p]:
                continue
            for k in range(1, len(judge.pp)):
                cand = pp.copy()
                cand[s, p] = k
                if judge.objective(cand, dp) <= bound:
                    pp, moved = cand, True
                    break
        for s in range(len(dp) if groups else 0):
            if dp[s]:
                continue
            for k in range(1, len(judge.dp)):
                cand = dp.copy()
                cand[s] = k
                if judge.objective(pp, cand) <= bound:
                    dp, moved = cand, True
                    break
        if not moved:
            break
    return pp, dp


def choose_compression(model: CostModel, X: np.ndarray, *, micro_batches: int | None = None,
                       overlap_allreduce: bool = True, engine_syncs: bool = False,
                       min_saving_fraction: float = 0.0, efficiency: Mapping[str, float] | None = None,
                       error_fraction: float = 0.0, window_messages: int | None = None) -> CompressionPlan:
    """The codec of every link and group of allocation X ((S, D): X[s, p] the peer of stage s in
    pipeline p) from `model.options`, and why (see the module's docstring).

    By predicted iteration time (`efficiency` None): min_saving_fraction: a more lossy choice
    must shorten the predicted iteration by at least this fraction of the exact iteration (0:
    any saving; the plan is then never predicted slower than the best global setting; above 0,
    by at most that fraction).

    By predicted time to a target loss (`efficiency`: step efficiency by codec method, e.g.
    `STEP_EFFICIENCY`): the objective is iteration time / the plan's `step_efficiency`, and a
    link or group is left exact only where that lowers the objective by more than
    `error_fraction` (the predictor's relative error) of the more compressed plan's; a plan
    whose links all save less stays compressed. `min_saving_fraction` is not used then.
    window_messages: the trainer's flow-control window, as `simulate` takes it."""
    if not 0 <= min_saving_fraction < 1:
        raise ValueError(f"min_saving_fraction must lie in [0, 1), got {min_saving_fraction!r}")
    if not 0 <= error_fraction < 1:
        raise ValueError(f"error_fraction must lie in [0, 1), got {error_fraction!r}")
    if efficiency is not None:
        bad = {m: v for m, v in efficiency.items() if not 0 < v <= 1}
        if bad:
            raise ValueError(f"step efficiencies must lie in (0, 1], got {bad}")
    X = np.asarray(X, dtype=np.int64)
    S, D = X.shape
    kw = {"micro_batches": micro_batches, "overlap_allreduce": overlap_allreduce, "engine_syncs": engine_syncs,
          "window_messages": window_messages}
    judge = _Judge(model, X, kw, efficiency=efficiency, error_fraction=error_fraction)
    opts = model.options
    groups = D > 1
    zeros_pp, zeros_dp = np.zeros((max(S - 1, 0), D), dtype=np.int64), np.zeros(S, dtype=np.int64)
    exact_t = judge.time(zeros_pp, zeros_dp)
    judge.margin = min_saving_fraction * exact_t
    best_g = None
    for i in range(len(opts.pp) if S > 1 else 1):
        for j in range(len(opts.dp) if groups else 1):
            pp, dp = np.full_like(zeros_pp, i), np.full_like(zeros_dp, j)
            t, loss = judge.score(pp, dp)
            if best_g is None or judge.better(t, loss, best_g[0], best_g[1]):
                best_g = (t, loss, pp, dp, (opts.pp[i].name, opts.dp[j].name))
    assert best_g is not None
    T = _link_times(model, X) if S > 1 else np.zeros((0, D, len(opts.pp)))
    results = []
    for pp0, dp0 in ((zeros_pp, zeros_dp), (best_g[2], best_g[3])):
        pp, dp = _descend(judge, T, pp0, dp0, groups)
        results.append((*judge.score(pp, dp), pp, dp))
    t_best, loss_best, pp, dp = results[0]
    if judge.better(results[1][0], results[1][1], t_best, loss_best):
        t_best, loss_best, pp, dp = results[1]
    return _explain(model, X, judge, T, pp, dp, judge.time(pp, dp), exact_t, best_g[4], judge.time(best_g[2], best_g[3]))


def _explain(model: CostModel, X: np.ndarray, judge: _Judge, T: np.ndarray, pp: np.ndarray, dp: np.ndarray,
             t: float, exact_t: float, best_names: tuple[str, str], best_t: float) -> CompressionPlan:
    S, D = X.shape
    wl = model.workload
    layers, _ = model.group_layers(X)
    if wl.layer_compute_s is None:
        fwd = np.zeros((S, D))
    else:
        fwd = layers[:, None] * wl.layer_compute_s / model.speed[X] / 3
    links = []
    for s, p in np.ndindex(*pp.shape):
        k = int(pp[s, p])
        overlap = float(max(fwd[s, p], fwd[s + 1, p]))
        if k:
            cand = pp.copy()
            cand[s, p] = 0
            saving = judge.time(cand, dp) - t
            reason = ChoiceReason.WITHIN_ERROR if judge.to_loss and saving <= _REL_TOL * t else ChoiceReason.SLOW
        else:
            saving = 0.0
            if len(judge.pp) == 1:
                reason = ChoiceReason.NO_OPTIONS
            elif T[s, p, 1:].min() >= T[s, p, 0]:
                reason = ChoiceReason.CODING_TOO_SLOW
            elif wl.micro_batches > 1 and T[s, p, 0] <= overlap:
                reason = ChoiceReason.HIDDEN
            else:
                reason = ChoiceReason.OFF_CRITICAL_PATH
        links.append(LinkChoice(s, p, int(X[s, p]), int(X[s + 1, p]), judge.pp[k], float(T[s, p, 0]),
                                float(T[s, p, k]), overlap, float(saving), reason))
    groups = []
    for s in range(S):
        k = int(dp[s])
        codec = judge.dp[k]
        row = X[s:s + 1]
        exact_sync = float(model.dp_rows_codec(row, layers[s:s + 1], judge.dp[0]).max()) if D > 1 else 0.0
        sync = float(model.dp_rows_codec(row, layers[s:s + 1], codec, amortised=False).max()) if D > 1 else 0.0
        if k:
            cand = dp.copy()
            cand[s] = 0
            saving = judge.time(pp, cand) - t
            reason = ChoiceReason.WITHIN_ERROR if judge.to_loss and saving <= _REL_TOL * t else ChoiceReason.SLOW
        else:
            saving = 0.0
            if D == 1:
                reason = ChoiceReason.NO_GROUP
            elif len(judge.dp) == 1:
                reason = ChoiceReason.NO_OPTIONS
            elif judge.to_loss and any(judge.time(pp, _with(dp, s, j)) < t * (1 - _REL_TOL) for j in range(1, len(judge.dp))):
                reason = ChoiceReason.STEP_EFFICIENCY
            elif min(float(model.dp_rows_codec(row, layers[s:s + 1], c).max()) for c in judge.dp[1:]) >= exact_sync:
                reason = ChoiceReason.CODING_TOO_SLOW
            else:
                reason = ChoiceReason.OFF_CRITICAL_PATH
        groups.append(GroupChoice(s, tuple(int(v) for v in X[s]), codec, exact_sync, sync,
                                  codec.period_steps if D > 1 else 1, float(saving), reason))
    return CompressionPlan(judge.assignment(pp, dp), tuple(links), tuple(groups), float(t), float(exact_t),
                           best_names, float(best_t))
