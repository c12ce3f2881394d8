"""From the gossiped view to a placement: the scheduler's input for the model the swarm trains,
and its answer in peer ids (`Placement`); for a per-link compressed run, which of its links and
DP groups compress (`choose_links`). The protocol is in docs/control.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from dtfm.gossip import NetworkView
from dtfm.sched import (REFERENCE_CODEC_SPEED, STEP_EFFICIENCY, TRAINER_WINDOW_MESSAGES, CodecAssignment, CodecSpeed,
                        CompressionOptions, CompressionPlan, CostModel, ScheduleInputs, choose_compression,
                        fitted_warmups, layer_ranges, simulate_iteration, step_efficiency, wire_codecs)
from dtfm.sched import shape_space as sched_shape_space
from dtfm.train import CompressionConfig, GPTSpec, LinkCodecs, TrainConfig

from ..compute import peer_compute, run_model, sched_spec
from .request import PLACEMENTS

__all__ = ["MAX_WARMUPS_TEXT", "PLACEMENTS", "Placement", "choose_links", "choose_shape", "codec_speeds_of",
           "compression_options_of", "compute_busy_fraction", "fit_schedule",
           "predict_uniform", "random_shape", "sched_spec", "shape_space", "time_to_loss_s", "view_matrices"]

@dataclass(frozen=True)
class Placement:
    """Who runs what (pipelines of peers, their layer ranges, the spares) and its prediction."""

    pipelines: tuple[tuple[bytes, ...], ...]  # [d][s]: peer id
    layer_ranges: tuple[tuple[int, int], ...]
    spares: tuple[bytes, ...]
    predicted_iteration_s: float  # the simulator on the measured view, with the trainer's syncs and schedule
    objective_s: float  # the paper's cost (DP + 2 x PP) of this allocation
    # A per-link run: which links and DP groups use the run's codecs (`choose_links`), and why, in words.
    links: LinkCodecs | None = None
    links_note: str = ""
    shape_note: str = ""  # why this shape: its prediction against the others tried (`FastestShape.note`)
    inputs: ScheduleInputs | None = None  # a first placement's: what the scheduler chose it on
    # The micro-batch count the scheduler chose with the shape (a run whose start left it to the
    # scheduler, `TrainRequest.auto_micro_batches`); None: the run's own.
    micro_batches: int | None = None
    # Each stage's forwards before its first backward (`fit_schedule`, `TrainConfig.pipeline_warmups`);
    # None: GPipe.
    warmups: tuple[int, ...] | None = None

    def warmups_text(self) -> str:
        """The warm-ups as `TrainConfig.pipeline_warmups` writes them ('' for GPipe)."""
        return "" if self.warmups is None else ",".join(map(str, self.warmups))


def shape_space(n: int, spec: GPTSpec, cfg: TrainConfig, *, stages: int | None = None,
                dp: int | None = None, compute_costed: bool = True,
                auto_micro_batches: bool = False, even_layers: bool = True) -> list[tuple[int, int]]:
    """Every (S, D) a run of `spec` may take on n live peers (`dtfm.sched.shape_space`): S
    divides the layers (unless not `even_layers`), spares allowed, D at most the micro-batch
    count allows (one micro-batch of one sequence per pipeline when the scheduler chooses the
    count)."""
    return sched_shape_space(n, spec.n_layer, run_model(spec, cfg, auto_micro_batches=auto_micro_batches).d_max,
                             stages=stages, dp=dp, compute_costed=compute_costed, even_layers=even_layers)


def choose_shape(view: NetworkView, spec: GPTSpec, cfg: TrainConfig, *, stages: int | None, dp: int | None,
                 regions: dict[bytes, str] | None = None, time_budget_s: float = 5.0,
                 seed: int = 0, compression: CompressionOptions | None = None,
                 kind: Mapping[int, float] | None = None, auto_micro_batches: bool = False,
                 window_messages: int = TRAINER_WINDOW_MESSAGES, fit_schedules: bool = False) -> Placement:
    """Run the DT-FM scheduler on the view. stages=None picks the shape too ("auto"): every
    shape of `shape_space` (peers left out as spares included) is searched, and the one the
    simulator predicts fastest per step wins (`dtfm.sched.solve_fastest`: the global batch is
    the run's whatever the shape, so the fastest step is the fastest to the run's target).
    Each peer's compute is costed at its reported speed (`peer_compute`); when no peer
    reported one, only the shapes that place every peer are searched. stages given without dp:
    every count of pipelines of it the peers form, spares allowed, when compute is costed (else
    the most). compression: the codecs each link and group may use, for a search that knows
    them (None: exact), and then shapes are ranked by time to the target loss (the iteration
    over the shape's step efficiency: `dtfm.sched.shape_step_efficiency`). kind: the run's
    layer's `kind_factors` (none: the reference rate). auto_micro_batches: the micro-batch count is searched with the
    shape (`dtfm.sched.micro_batch_options`; the placement's `micro_batches` is the one chosen),
    else the run's (`cfg.micro_batches`) is kept. window_messages: the swarm's flow-control window
    (`CommConfig.window_messages`), which the simulator costs. fit_schedules: the run's stages
    take the pipeline schedule fitted to their links (`fit_schedule`), so shapes are ranked
    under the schedule fitted to each (`dtfm.sched.solve_fastest`); the placement's prediction
    stays its GPipe figure, which `fit_schedule` scales. The placement carries its inputs
    (`ScheduleInputs`: what `dtfm-sched solve --view` replays) and why the shape (`shape_note`).

    ValueError when the view is incomplete or the shape does not fit the live peers."""
    n = len(view.peers)
    if not view.complete:
        raise ValueError(f"the network view is incomplete ({view.pairs_known()} of {n * (n - 1)} links "
                         "measured): wait until gossip has measured every link")
    delay, bw = view_matrices(view)
    pc = peer_compute(view, kind)
    inputs = ScheduleInputs(tuple(p.hex() for p in view.peers), tuple((regions or {}).get(p, "") for p in view.peers),
                            delay, bw, pc.speeds, pc.reference_tflops, pc.kind,
                            run_model(spec, cfg, auto_micro_batches=auto_micro_batches), stages, dp, seed, time_budget_s,
                            window_messages=window_messages, compression=compression, fit_schedules=fit_schedules)
    shapes = inputs.shapes()
    if not shapes:
        raise ValueError(f"no shape of {n} live peers fits {spec.n_layer} layers"
                         + (f" as {stages} stages" if stages is not None else "")
                         + (f" x {dp} pipelines" if dp is not None else ""))
    found = inputs.solve()
    alloc = found.alloc
    ids = view.peers
    note = found.note(n) + "; " + pc.describe()
    inputs = replace(inputs, chosen={"stages": alloc.stages, "dp": alloc.dp, "micro_batches": found.micro_batches,
                                     "pipelines": [list(p) for p in alloc.pipelines],
                                     "predicted_iteration_s": found.iteration_s, "note": note})
    return Placement(tuple(tuple(ids[i] for i in pipe) for pipe in alloc.pipelines), alloc.layer_ranges,
                     tuple(ids[i] for i in alloc.spares), found.iteration_s, float(alloc.cost.paper_s),
                     shape_note=note, inputs=inputs,
                     micro_batches=found.micro_batches if auto_micro_batches else None)


def random_shape(view: NetworkView, spec: GPTSpec, cfg: TrainConfig, *, stages: int, dp: int,
                 seed: int = 0, kind: Mapping[int, float] | None = None,
                 window_messages: int = TRAINER_WINDOW_MESSAGES) -> Placement:
    """A uniformly random allocation of `stages` x `dp` over the view's peers, even layer split,
    with the simulator's prediction on the view: the baseline the scheduler's allocation is
    compared with. ValueError when the view is incomplete or the shape does not fit."""
    n = len(view.peers)
    if not view.complete:
        raise ValueError(f"the network view is incomplete ({view.pairs_known()} of {n * (n - 1)} links "
                         "measured): wait until gossip has measured every link")
    if stages * dp > n:
        raise ValueError(f"{stages} stages x {dp} pipelines need {stages * dp} peers, {n} are live")
    ranges = tuple(layer_ranges(spec.n_layer, stages))
    order = np.random.default_rng(seed).permutation(n)
    X = order[:stages * dp].reshape(dp, stages).T  # (S, D)
    delay, bw = view_matrices(view)
    pc = peer_compute(view, kind)
    model = CostModel(delay, bw, pc.spec(spec, cfg, dp).workload(stages, dp),
                      compute=pc.speeds)
    sim = simulate_iteration(model, X, micro_batches=cfg.micro_batches, engine_syncs=True,
                             window_messages=window_messages)
    ids = view.peers
    return Placement(tuple(tuple(ids[i] for i in X[:, d]) for d in range(dp)), ranges,
                     tuple(ids[i] for i in order[stages * dp:]), float(sim.iteration_s),
                     float(model.breakdown(X).paper_s))


def view_matrices(view: NetworkView) -> tuple[np.ndarray, np.ndarray]:
    """The view's delay (ms, unknown 0) and bandwidth (Gbps, unknown and self infinite)."""
    delay = np.nan_to_num(view.delay_ms, nan=0.0)
    bw = np.where(np.isnan(view.bandwidth_gbps), np.inf, view.bandwidth_gbps)
    np.fill_diagonal(bw, np.inf)
    return delay, bw


# A per-link run leaves a link or group exact only where that is predicted to shorten the time to
# the target loss (iteration time / step efficiency, `STEP_EFFICIENCY`) by more than the
# simulator's error: a smaller predicted saving may be none. The error measured on the emulated
# worldwide swarm of 8 daemons (bench/compress_swarm.py, simulator with the trainer's round
# trips on the view the daemons measured, compute from the exact run): at the bench's scale
# 0.011, two runs of 3 fresh swarms each on 2026-11-29, exact 0.1-3.5 %, slow-link 4.2-12.7 %,
# auto 2.8-16.8 % (the larger figures on a machine at load 23-28); at 0.0285 (2026-11-26) up to
# 10.0 % (docs/compression.md). The largest, rounded down.
PREDICTION_ERROR_FRACTION = 0.16


def codec_speeds_of(view: NetworkView, fallback: CodecSpeed = REFERENCE_CODEC_SPEED) -> tuple[CodecSpeed, ...]:
    """Each view peer's coding speed: the one it measured and gossiped, `fallback` where it
    reported none (`view.codec_known()` says which)."""
    known = view.codec_known()
    return tuple(CodecSpeed.from_vector(row) if ok else fallback for row, ok in zip(view.codec_ns, known))


def compression_options_of(config: CompressionConfig, speed: CodecSpeed = REFERENCE_CODEC_SPEED, *,
                           view: NetworkView | None = None) -> CompressionOptions:
    """What a per-link run lets the scheduler choose: exact or the run's own codec, on each axis.
    Coding is costed at `speed` on every peer, or, given the view the cost model is built on,
    at each peer's own measured speed (`speed` where it has none: `codec_speeds_of`)."""
    pp, dp = wire_codecs(config)
    return CompressionOptions((type(pp)(),) + (() if pp.exact else (pp,)), (type(dp)(),) + (() if dp.exact else (dp,)),
                              speed, () if view is None else codec_speeds_of(view, speed))


def _placement_model(view: NetworkView, placement: Placement, spec: GPTSpec, cfg: TrainConfig,
                     compression: CompressionConfig, speed: CodecSpeed,
                     kind: Mapping[int, float] | None) -> tuple[np.ndarray, CostModel]:
    """The placement as an (S, D) matrix of view indices, and the cost model of a compressed
    run of it on the view: each peer's compute and coding speed, exact or the run's codec on
    each link and group (`compression_options_of`). ValueError for a peer the view lacks."""
    ids = {p: i for i, p in enumerate(view.peers)}
    if any(p not in ids for pipe in placement.pipelines for p in pipe):
        raise ValueError("the placement names a peer the network view does not hold")
    X = np.array([[ids[pipe[s]] for pipe in placement.pipelines] for s in range(len(placement.layer_ranges))],
                 dtype=np.int64)  # (S, D)
    S, D = X.shape
    delay, bw = view_matrices(view)
    pc = peer_compute(view, kind)
    model = CostModel(delay, bw, pc.spec(spec, cfg, D).workload(S, D), compute=pc.speeds,
                      compression=compression_options_of(compression, speed, view=view))
    return X, model


def predict_uniform(view: NetworkView, placement: Placement, spec: GPTSpec, cfg: TrainConfig,
                    compression: CompressionConfig, *, speed: CodecSpeed = REFERENCE_CODEC_SPEED,
                    kind: Mapping[int, float] | None = None,
                    window_messages: int = TRAINER_WINDOW_MESSAGES) -> Placement:
    """`placement` with the prediction of a uniformly compressed run: the simulator with the run's
    codecs on every link and DP group (each peer's coding at its own speed, the view's), as that
    run codes them (the search costed each link's cheaper of exact and the codec), under the
    placement's pipeline schedule. `cfg`: the run's training config with the placement's
    micro-batch count (`train_of`)."""
    X, model = _placement_model(view, placement, spec, cfg, compression, speed, kind)
    S, D = X.shape
    pp, dp = wire_codecs(compression)
    predicted = simulate_iteration(model, X, micro_batches=cfg.micro_batches, engine_syncs=True,
                                   codecs=CodecAssignment.uniform(S, D, pp, dp), window_messages=window_messages,
                                   warmups=placement.warmups)
    return replace(placement, predicted_iteration_s=float(predicted.iteration_s))


# The longest warm-up list an allocation carries (its training config's strings are bounded at
# 256 characters): a pipeline whose counts take more runs GPipe.
MAX_WARMUPS_TEXT = 240


def fit_schedule(view: NetworkView, placement: Placement, spec: GPTSpec, cfg: TrainConfig,
                 compression: CompressionConfig, *, kind: Mapping[int, float] | None = None,
                 speed: CodecSpeed = REFERENCE_CODEC_SPEED,
                 window_messages: int = TRAINER_WINDOW_MESSAGES) -> Placement:
    """`placement` with the pipeline schedule the simulator finds fastest for it
    (`dtfm.sched.fitted_warmups`: 1F1B with each stage's warm-up fitted to its hops' round trips,
    or GPipe) and its prediction under that schedule: the placement's own prediction scaled by
    how much faster the schedule simulates than GPipe on the placement's codecs. `cfg`: the run's
    training config at the placement's micro-batch count (`train_of`). GPipe where no schedule
    is faster, or where the counts would not fit an allocation (`MAX_WARMUPS_TEXT`)."""
    X, model = _placement_model(view, placement, spec, cfg, compression, speed, kind)
    fit = fitted_warmups(model, X, cfg.micro_batches, window_messages, codecs=_codecs_of(placement, compression))
    text = "" if fit.warmups is None else ",".join(map(str, fit.warmups))
    if fit.warmups is None or len(text) > MAX_WARMUPS_TEXT:
        return replace(placement, warmups=None)
    predicted = placement.predicted_iteration_s * fit.iteration_s / fit.gpipe_s
    note = (f"; pipeline schedule 1F1B, warm-ups {text}: predicted {predicted:.3f} s/step "
            f"({placement.predicted_iteration_s / predicted:.2f}x GPipe's)")
    return replace(placement, warmups=fit.warmups, predicted_iteration_s=predicted,
                   shape_note=placement.shape_note + note if placement.shape_note else "")


def _codecs_of(placement: Placement, compression: CompressionConfig) -> CodecAssignment:
    """The codecs each link and group of the placement uses: the run's everywhere, exact
    everywhere, or (a per-link run) as its links say."""
    S, D = len(placement.layer_ranges), len(placement.pipelines)
    if compression.exact:
        return CodecAssignment.uniform(S, D)
    pp, dp = wire_codecs(compression)
    links = placement.links
    if links is None:
        return CodecAssignment.uniform(S, D, pp, dp)
    return CodecAssignment.chosen(pp, dp, links.pp, links.dp)


def compute_busy_fraction(view: NetworkView, placement: Placement, spec: GPTSpec, cfg: TrainConfig, *,
                          kind: Mapping[int, float] | None = None) -> float:
    """The share of a step its busiest peer computes, in [0, 1]: the simulator's compute time of
    that peer (forward, backward and the update, at the view's speeds) over the placement's
    predicted iteration. `cfg`: the run's training config with the placement's micro-batch count
    (`train_of`)."""
    if not placement.predicted_iteration_s > 0:
        return 1.0
    X, model = _placement_model(view, placement, spec, cfg, CompressionConfig(), REFERENCE_CODEC_SPEED, kind)
    # (the compute alone: one round of the schedule gives it; the links and syncs do not change it)
    busy = simulate_iteration(model, X, micro_batches=cfg.micro_batches).compute_busy_s
    return min(1.0, busy / placement.predicted_iteration_s)


def time_to_loss_s(placement: Placement, compression: CompressionConfig,
                   efficiency: Mapping[str, float] = STEP_EFFICIENCY) -> float:
    """A per-link placement's predicted iteration over the step efficiency of the codecs its
    links and groups use (`dtfm.sched.step_efficiency`): what it takes per exact step's worth of
    progress towards the target loss. A placement with no per-link choice: its iteration."""
    if placement.links is None:
        return placement.predicted_iteration_s
    return placement.predicted_iteration_s / step_efficiency(_codecs_of(placement, compression), efficiency)


def choose_links(view: NetworkView, placement: Placement, spec: GPTSpec, cfg: TrainConfig,
                 compression: CompressionConfig, *, keep_compressed: Sequence[tuple[int, int]] = (),
                 speed: CodecSpeed = REFERENCE_CODEC_SPEED,
                 error_fraction: float = PREDICTION_ERROR_FRACTION,
                 efficiency: Mapping[str, float] = STEP_EFFICIENCY,
                 kind: Mapping[int, float] | None = None,
                 window_messages: int = TRAINER_WINDOW_MESSAGES) -> Placement:
    """`placement` with the links and DP groups of a per-link run chosen by the scheduler
    (`dtfm.sched.choose_compression`) on the view, by predicted time to the target loss: the
    simulator's iteration time divided by the plan's step efficiency (`efficiency`, measured per
    codec). Every link and group takes the run's codec unless leaving it exact lowers that by
    more than `error_fraction` (the simulator's measured error): a DP group whose saving does not
    pay for the steps DiLoCo loses stays exact, a link whose coding costs more than the error
    stays exact, and a link that saves nothing the prediction can tell apart compresses. Coding
    is costed at each peer's own speed as the view holds it (a link's encode on its sender, its
    decode on its receiver, a group member's on that member), at `speed` (the reference CPU's
    by default) for a peer that reported none; the note says how many placed peers had a
    measured speed.

    keep_compressed: layer ranges whose DP group synchronised with the run's DP method in the
    epoch before; a group holding any of their layers keeps it. Between synchronisations the
    replicas of such a group differ, and an exact all-reduce would keep them apart for good
    (an exact group can turn compressed at any step: its anchor follows its weights).
    The prediction is the simulator's iteration time with the chosen codecs (and the swarm's
    flow-control window, `window_messages`)."""
    X, model = _placement_model(view, placement, spec, cfg, compression, speed, kind)
    S, D = X.shape
    opts = model.options
    placed = np.unique(X)
    measured = int(view.codec_known()[placed].sum())
    plan = choose_compression(model, X, micro_batches=cfg.micro_batches, engine_syncs=True,
                              efficiency=efficiency, error_fraction=error_fraction, window_messages=window_messages)
    pp = tuple(tuple(not c.exact for c in row) for row in plan.assignment.pp)
    kept = tuple(any(a < end and start < b for a, b in keep_compressed) for start, end in placement.layer_ranges)
    dp = tuple(not c.exact or k for c, k in zip(plan.assignment.dp, kept))
    if D == 1 or compression.dp_method == "exact":
        dp = (False,) * S  # (one pipeline, or no DP method: nothing to synchronise compressed)
    links = LinkCodecs(pp, dp)
    predicted = plan.iteration_s
    if dp != tuple(not c.exact for c in plan.assignment.dp):
        codecs = CodecAssignment(plan.assignment.pp, tuple(opts.dp[-1] if on else opts.dp[0] for on in dp))
        predicted = float(simulate_iteration(model, X, micro_batches=cfg.micro_batches, engine_syncs=True,
                                             codecs=codecs, window_messages=window_messages).iteration_s)
    return replace(placement, links=links, links_note=_note(plan, links, compression, predicted, (measured, len(placed))),
                   predicted_iteration_s=predicted)


def _saving(saving_s: float) -> str:
    """What a compressed link or group saves, in words; a saving within the prediction's
    error shows as what exact would save instead."""
    if saving_s > 0:
        return f"saves {saving_s:.3f} s/iter"
    return f"exact would save {max(0.0, -saving_s):.3f} s/iter, within the error"


def _note(plan: CompressionPlan, links: LinkCodecs, compression: CompressionConfig, predicted_s: float,
          measured: tuple[int, int]) -> str:
    """"links compressed: p0 s0->s1 int4+hadamard/64 (saves 0.120 s/iter); exact links: 1 (1 hidden);
    DP groups compressed: ...; predicted ...; coding at measured speeds of 7/8 peers" in one line."""
    parts = []
    for c in plan.links:
        if links.pp[c.stage][c.pipeline]:
            parts.append(f"p{c.pipeline} s{c.stage}->s{c.stage + 1} {compression.pp_name} ({_saving(c.saving_s)})")
    exact_links = sum(1 for row in links.pp for on in row if not on)
    reasons: dict[str, int] = {}
    for c in plan.links:
        if not links.pp[c.stage][c.pipeline]:
            reasons[c.reason.value] = reasons.get(c.reason.value, 0) + 1
    out = "links compressed: " + (", ".join(parts) if parts else "none")
    if exact_links:
        out += f"; exact links: {exact_links} (" + ", ".join(f"{k} {r}" for r, k in reasons.items()) + ")"
    groups = []
    for g in plan.groups:
        if links.dp[g.stage]:
            why = "kept: its replicas differ until they synchronise" if g.codec.exact else _saving(g.saving_s)
            groups.append(f"s{g.stage} {compression.dp_name} ({why})")
    out += "; DP groups compressed: " + (", ".join(groups) if groups else "none")
    out += f"; predicted {predicted_s:.3f} s/iter (exact {plan.exact_iteration_s:.3f} s)"
    known, placed = measured
    return out + (f"; coding at measured speeds of {known}/{placed} peers" if known == placed else
                  f"; coding at measured speeds of {known}/{placed} peers (reference CPU for the rest)")
