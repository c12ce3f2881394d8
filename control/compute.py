"""Each peer's compute speed, as the scheduler reads it and as a peer measures it.

A peer reports `compute_ms` in its signed gossip report: the forward and backward time, in ms,
of gossip's reference block (`dtfm.gossip.REFERENCE_BLOCK`: a transformer block of width 256,
4 heads, 128 tokens, batch 4). It probes the block once at start; once it trains a stage, its
own steps measure it better (the stage's real layers at the run's micro-batch, on a machine as
loaded as it is): `ComputeGauge` turns the compute seconds of its last steps into the same
unit, and the daemon reports that instead (`GossipService.set_compute_ms`), with the share of a
core its compute had meanwhile (CPU time over wall time: below 1 where other peers of its machine
trained beside it), so that the planner can take each figure of its own machine at a whole core
(`with_fresh_compute`) before it counts the contention of the peers it places. A
reconfiguration costs a peer that never trained no faster than its machine's training peers
measure (`with_training_compute`): the allocation in use is costed at its own steps, and idle
daemons' start-up probes would make every other allocation look faster on a loaded machine.

The scheduler turns the figures into its compute term (`peer_compute`): the median reporting
peer's achieved TFLOP/s on the reference block is the speed-1.0 peer (`reference_tflops`), each
peer's speed is the median's time over its own (a peer without a figure is taken at 1.0), and
`sched_spec` describes the model at that speed, the output head's compute on the last stage
included. The time per layer follows each stage's FLOPs at the run's micro-batch.

A model's layers do not run at the reference block's FLOP rate: a narrow layer or a small
micro-batch runs slower per FLOP (`tiny`'s 128-wide layer at 1.2-1.6x the time its FLOPs say on
a CPU core), a wide one about as fast. `kind_factors` measures that ratio for the run's layer at
each micro-batch size, the reference block beside it: the coordinator's planner scales the
compute term by it, and a training peer divides its own figure by it before reporting, so every
gossiped figure stays in reference-block units whatever the run.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from dataclasses import dataclass, field, replace

import numpy as np

from dtfm.gossip import REFERENCE_BLOCK, NetworkView
from dtfm.sched import UPDATE_KIND, ModelSpec, RunModel, update_s_per_param
from dtfm.train import GPTSpec, TrainConfig

__all__ = ["ComputeGauge", "GAUGE_SKIP_STEPS", "GAUGE_STEPS", "KindProbe", "MachineNow", "PeerCompute", "kind_factors",
           "micro_batch_seqs", "paired_ratio", "peer_compute", "pipeline_seqs", "reference_block_flops", "run_model", "sched_spec", "training_block_ms",
           "update_flops_per_param", "with_fresh_compute", "with_training_compute"]

GAUGE_STEPS = 8  # steps whose median a training peer reports
KIND_MAX_LAYER_S = 2.0  # a micro-batch whose layer the reference predicts slower than this is not probed (factor 1)
KIND_REPEATS = 3  # timed runs of each (after one warm-up), at least: the median counts
KIND_MIN_S = 2.0  # ... and runs of each for at least this long (a loaded machine's time slices average out)
GAUGE_SKIP_STEPS = 2  # an epoch's first steps left out (allocation, caches and the first sends warm up)
SHARE_NOISE = 0.1  # a probe's share of a core this close to one is taken as partly noise (`MachineNow.slowdown`)
SLOWDOWN_ROUNDS = 200  # `MachineNow.training_slowdown`'s rounds at most (it settles well before)


def run_model(spec: GPTSpec, cfg: TrainConfig, *, auto_micro_batches: bool = False) -> RunModel:
    """The numbers of the model the trainer builds and its batch, as the scheduler reads them
    (`auto_micro_batches`: the scheduler chooses the micro-batch count)."""
    return RunModel(spec.name, spec.n_layer, spec.n_embd, spec.n_head, spec.seq_len, spec.vocab,
                    cfg.global_batch_seqs, cfg.micro_batches, 4 if cfg.wire_dtype == "float32" else 2,
                    auto_micro_batches=auto_micro_batches)


def sched_spec(spec: GPTSpec, cfg: TrainConfig, dp: int, *, reference_tflops: float | None = None,
               update_s_per_param: float = 0.0) -> ModelSpec:
    """The scheduler's description of the model the trainer builds, for D pipelines; with
    `reference_tflops` (a speed-1.0 peer's achieved TFLOP/s) its compute is costed, the output
    head on the last stage and the optimizer's update (`update_s_per_param`) included; without,
    compute is free."""
    return run_model(spec, cfg).spec(dp, reference_tflops, update_s_per_param=update_s_per_param)


def reference_block_flops() -> float:
    """Forward and backward FLOPs of the reference block, counted as the scheduler counts a layer's."""
    width, heads, seq_len, batch = REFERENCE_BLOCK
    return ModelSpec("reference", 1, width, heads, seq_len, 1, batch, batch).layer_flops()


def micro_batch_seqs(cfg: TrainConfig, dp: int) -> int:
    """Sequences per micro-batch of a run of D = `dp` pipelines, as the scheduler counts them."""
    return RunModel("", 1, 1, 1, 1, 1, cfg.global_batch_seqs, cfg.micro_batches).micro_batch(dp)


def kind_factors(spec: GPTSpec, batches: Iterable[int], *, repeats: int = KIND_REPEATS,
                 seed: int = 0, min_s: float = KIND_MIN_S) -> dict[int, float]:
    """For each micro-batch size, the forward and backward time of one of the model's layers
    over the time the reference block's (timed here too, just before) predicts by their FLOPs:
    how much slower per FLOP this model's layer runs. Sizes whose layer the reference predicts
    slower than KIND_MAX_LAYER_S are left out (their factor is 1: wide layers run at about the
    reference rate). Size `UPDATE_KIND` (0) asks for the optimizer update of the layer's
    parameters instead (`update_flops_per_param`). Blocking, imports torch: run it in a child
    process or a worker thread."""
    import torch  # (only this probe needs it)

    from dtfm.gossip import reference_block, time_block_ms
    from dtfm.train import Block

    batches = set(batches)
    ref, ref_x = reference_block(seed=seed)
    ref_ms = min(time_block_ms(ref, ref_x) for _ in range(2))  # (warmed up)
    ref_flops = reference_block_flops()
    flops = {b: ModelSpec(spec.name, 1, spec.n_embd, spec.n_head, spec.seq_len, 1, b, b).layer_flops()
             for b in sorted(batches) if b >= 1}
    flops = {b: f for b, f in flops.items() if ref_ms * f / ref_flops <= KIND_MAX_LAYER_S * 1e3}
    out: dict[int, float] = {}
    if not flops and UPDATE_KIND not in batches:
        return out
    torch.manual_seed(seed)
    block = Block(spec)
    if UPDATE_KIND in batches:
        out[UPDATE_KIND] = update_flops_per_param(block, ref, ref_x, repeats=repeats, min_s=min_s)
    for b, f in flops.items():
        x = torch.randn(b, spec.seq_len, spec.n_embd)
        time_block_ms(block, x)  # (warms up)
        # each run against a reference run just after it: a machine whose load changes moves both
        ratio = paired_ratio(lambda: time_block_ms(block, x), lambda: time_block_ms(ref, ref_x),
                             min_runs=repeats, min_s=min_s)
        out[b] = ratio * ref_flops / f
    return out


PAIRED_CHUNK_MS = 200.0  # runs in turn summed into chunks of at least this much time, each one ratio


def paired_ratio(run: Callable[[], float], reference: Callable[[], float], *, min_runs: int, min_s: float,
                 max_runs: int = 200) -> float:
    """The time of `run` over `reference`'s (both in ms): each called in turn, at least
    `min_runs` times and for at least `min_s` seconds (at most `max_runs`); the pairs summed
    in order into chunks of at least PAIRED_CHUNK_MS, each chunk's sum over the other's, and
    the median of the chunks' ratios (with fewer than 3 chunks: the ratio of all the sums). On
    a loaded machine a run of a few ms loses a time slice or not, which sums of runs in turn
    average out; a stall of seconds in one run (a descheduled process) moves only its chunk."""
    t0 = time.perf_counter()
    chunks: list[float] = []
    total_run = total_ref = chunk_run = chunk_ref = 0.0
    k = 0
    while k < max_runs and (k < min_runs or time.perf_counter() - t0 < min_s):
        a, b = run(), reference()
        total_run, total_ref, chunk_run, chunk_ref = total_run + a, total_ref + b, chunk_run + a, chunk_ref + b
        k += 1
        if chunk_run + chunk_ref >= PAIRED_CHUNK_MS and chunk_ref > 0:
            chunks.append(chunk_run / chunk_ref)
            chunk_run = chunk_ref = 0.0
    return statistics.median(chunks) if len(chunks) >= 3 else total_run / total_ref


def update_flops_per_param(block: Any, ref: Any, ref_x: Any, *, repeats: int = KIND_REPEATS,
                           min_s: float = 0.0) -> float:
    """The optimizer update of `block`'s parameters as the trainer runs it (the squared
    gradient norm in float64, AdamW with weight decay on the matrices), in FLOP-equivalents per
    parameter at the reference block's rate (`ref` on `ref_x`, each run against a reference run
    just before it). Blocking, imports torch."""
    import torch

    from dtfm.gossip import time_block_ms
    from dtfm.train import AdamW

    params = dict(block.named_parameters())
    n = sum(p.numel() for p in params.values())
    opt = AdamW(params, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def update_ms() -> float:
        for p in params.values():
            p.grad = torch.randn_like(p)
        t0 = time.perf_counter()
        sq = torch.zeros((), dtype=torch.float64)
        for p in params.values():
            assert p.grad is not None
            sq += p.grad.double().pow(2).sum()
        float(sq)
        opt.step(1e-4)
        return (time.perf_counter() - t0) * 1000.0

    update_ms()  # (warms up: the moments are allocated)
    ratio = paired_ratio(update_ms, lambda: time_block_ms(ref, ref_x), min_runs=repeats, min_s=min_s)
    for p in params.values():
        p.grad = None
    return ratio * reference_block_flops() / n


def pipeline_seqs(cfg: TrainConfig, dp: int, pipeline: int | None = None) -> int:
    """Sequences a step of pipeline `pipeline` of D = `dp` computes (the trainer's split of the
    global batch: 16 over 3 pipelines is 5, 5 and 6); None: the largest pipeline's, as the
    simulator costs every pipeline."""
    g = cfg.global_batch_seqs
    if pipeline is None:
        return -(-g // dp)
    return g * (pipeline + 1) // dp - g * pipeline // dp


def training_block_ms(spec: GPTSpec, cfg: TrainConfig, dp: int, layers: int, last_stage: bool,
                      compute_s: float, kind: float = 1.0, pipeline: int | None = None) -> float | None:
    """The reference block's time on a peer whose stage of `layers` layers (the last stage:
    with the output head) computed for `compute_s` seconds in one step of pipeline `pipeline`
    (its own share of the global batch; None: the largest pipeline's) of a run of D = `dp`
    pipelines, its layer's `kind_factors` figure at the run's micro-batch taken out (`kind`);
    None for a figure that says nothing (no layers, no time)."""
    if layers < 1 or not compute_s > 0 or not kind > 0:
        return None
    mspec = sched_spec(spec, cfg, dp)
    micro = pipeline_seqs(cfg, dp, pipeline) / mspec.micro_batch_size  # the layer_flops() micro-batches computed
    work = micro * (layers + (mspec.head_layers_equivalent() if last_stage else 0.0)) * mspec.layer_flops()
    return compute_s * 1000.0 * reference_block_flops() / work / kind


class ComputeGauge:
    """A training peer's compute figure: the median reference-block time of its stage's last
    GAUGE_STEPS steps, an epoch's first GAUGE_SKIP_STEPS left out, and the median share of a
    core its compute had in them (`StepReport.core_share`)."""

    def __init__(self) -> None:
        self._epoch: tuple[bytes, int] | None = None
        self._seen = 0
        self._figures: deque[tuple[float, float | None]] = deque(maxlen=GAUGE_STEPS)

    def add(self, run_epoch: tuple[bytes, int], figure: float | None,
            share: float | None = None) -> tuple[float, float | None] | None:
        """One step's figure (`training_block_ms`) of (run, epoch) and its compute's share of a
        core (None: not measured); once there are at least three, the median figure and the
        median share (None unless every step kept had one), else None."""
        if run_epoch != self._epoch:
            self._epoch, self._seen = run_epoch, 0
        self._seen += 1
        if figure is None or self._seen <= GAUGE_SKIP_STEPS:
            return None
        self._figures.append((figure, share))
        if len(self._figures) < 3:
            return None
        shares = [sh for _, sh in self._figures]
        known = [sh for sh in shares if sh is not None]
        return (statistics.median(f for f, _ in self._figures),
                statistics.median(known) if len(known) == len(shares) else None)


# The planner's probe of a run's layer (`kind_factors` for a model and micro-batch sizes, in a
# child process: the daemon does not import torch); None where the daemon gives none.
KindProbe = Callable[[GPTSpec, tuple[int, ...]], Mapping[int, float]]


@dataclass(frozen=True)
class PeerCompute:
    """The scheduler's compute inputs for the peers of a view."""

    reference_tflops: float | None  # the median reporting peer's achieved TFLOP/s; None: no peer reported
    speeds: np.ndarray  # (N,) each peer's speed relative to it; 1.0 for a peer without a figure
    known: int  # peers with a figure
    kind: Mapping[int, float] = field(default_factory=dict)  # the run's layer's `kind_factors`

    def tflops(self, micro_batch: int) -> float | None:
        """A speed-1.0 peer's TFLOP/s on the run's layers at `micro_batch` sequences."""
        if self.reference_tflops is None:
            return None
        return self.reference_tflops / self.kind.get(micro_batch, 1.0)

    def spec(self, spec: GPTSpec, cfg: TrainConfig, dp: int) -> ModelSpec:
        """`sched_spec` for D = `dp` pipelines, its compute costed at these speeds."""
        return sched_spec(spec, cfg, dp, reference_tflops=self.tflops(micro_batch_seqs(cfg, dp)),
                          update_s_per_param=update_s_per_param(self.kind, self.reference_tflops))

    def describe(self) -> str:
        if self.reference_tflops is None:
            return "compute not costed (no peer reported its speed)"
        n = len(self.speeds)
        spread = f", speeds {self.speeds.min():.2f}-{self.speeds.max():.2f}" if n > 1 else ""
        layer = {b: v for b, v in self.kind.items() if b != UPDATE_KIND}
        kind = (", the run's layers at " + "/".join(f"{v:.2f}" for _, v in sorted(layer.items()))
                + "x its time per FLOP") if layer else ""
        if UPDATE_KIND in self.kind:
            kind += f", the update at {self.kind[UPDATE_KIND]:.0f} FLOP per parameter"
        return (f"compute at {self.reference_tflops * 1e3:.1f} GFLOP/s per peer (median of {self.known}/{n} "
                f"measured{spread}{kind})")


@dataclass(frozen=True)
class MachineNow:
    """The coordinator's own machine, timed just before a first placement."""

    compute_ms: float  # the reference block's time now (`compute_speed_ms`)
    cpu_share: float  # the share of a core one busy thread gets now, in (0, 1] (`cpu_share`)
    cpus: int  # the cores this process may run on

    def __post_init__(self) -> None:
        if not (math.isfinite(self.compute_ms) and self.compute_ms > 0):
            raise ValueError(f"compute_ms must be a positive number, got {self.compute_ms}")
        if not 0 < self.cpu_share <= 1:
            raise ValueError(f"cpu_share must be in (0, 1], got {self.cpu_share}")
        if self.cpus < 1:
            raise ValueError(f"cpus must be at least 1, got {self.cpus}")

    def slowdown(self, busy: int, utilisation: float = 1.0) -> float:
        """How much slower each of `busy` peers of this machine computes when they train than
        the probe did alone, each computing for the `utilisation` share of a step (a pipeline
        stage waits for its neighbours the rest of it). What took the probe's thread below a
        whole core is other work on the cores: R = cpus / share - 1 busy threads (none where it
        had a whole core; a share within SHARE_NOISE of one reads as that much of the load, as
        the probe's own timer and the machine's idle daemons take a little of any core). While
        a peer computes, each other placed peer computes too with the chance `utilisation`, so
        it gets min(1, cpus / (R + 1 + (busy - 1) * utilisation)) of a core, against the
        probe's min(1, cpus / (R + 1))."""
        if busy <= 1:
            return 1.0
        if not 0 <= utilisation <= 1:
            raise ValueError(f"utilisation must be in [0, 1], got {utilisation}")
        others = self.cpus / self.cpu_share - 1.0 if self.cpu_share < 1.0 else 0.0
        if self.cpu_share > 1.0 - SHARE_NOISE:
            others *= (1.0 - self.cpu_share) / SHARE_NOISE
        alone = min(1.0, self.cpus / (others + 1.0))
        return alone / min(1.0, self.cpus / (others + 1.0 + (busy - 1) * utilisation))

    def training_slowdown(self, busy: int, utilisation: float) -> float:
        """`slowdown` of `busy` peers of a plan whose busiest peer computes for the
        `utilisation` share of a step at the probe's speed: computing slower, each computes for
        a larger share of a (longer) step, taken as u' = u d / (1 + u (d - 1)) at slowdown d,
        the slowdown then found again until it settles."""
        d = 1.0
        for _ in range(SLOWDOWN_ROUNDS):
            d, last = self.slowdown(busy, min(1.0, utilisation * d / (1.0 + utilisation * (d - 1.0)))), d
            if abs(d - last) < 1e-9:
                break
        return d


def with_fresh_compute(view: NetworkView, host: bytes, ms: float) -> NetworkView:
    """The view with the figures of the peers whose reports name machine `host` scaled so that
    their median is `ms`, the reference block timed on that machine just now: their figures were
    probed when each daemon started (or as it trained before), on a machine whose load has moved
    since. Their ratios stay (a figure given to a daemon to stand for a slower one stays slower),
    each taken at a whole core first: a figure measured in training with a share of a core
    below 1 (`NetworkView.compute_share`: the machine's other peers training beside it) is
    multiplied by that share, so that the contention of a run that has ended does not make one
    peer of the machine look slower than another (the planner counts the contention of the peers
    it places, `MachineNow.slowdown`). Peers of other machines keep theirs; unchanged without a
    host, a figure, or a reported figure of that machine."""
    if not host or not (math.isfinite(ms) and ms > 0):
        return view
    figures = np.asarray(view.compute_ms, dtype=float)
    mine = np.array([h == host for h in view.hosts], dtype=bool) & np.isfinite(figures) & (figures > 0)
    if not mine.any():
        return view
    share = np.asarray(view.compute_share, dtype=float)
    whole = figures * np.where(np.isfinite(share) & (share > 0) & (share <= 1), share, 1.0)
    scale = ms / float(np.median(whole[mine]))
    return replace(view, compute_ms=np.where(mine, whole * scale, figures))


def with_training_compute(view: NetworkView) -> NetworkView:
    """The view with each peer that reported only its start-up probe raised to the median figure
    its machine's training peers report from their own steps (`NetworkView.compute_share` known:
    `ComputeGauge`), where that is slower: what a machine gives a stage now is what its training
    peers measure, not what an idle daemon timed at its start. A reconfiguration weighs the
    allocation in use, costed at its peers' own steps, against allocations of idle peers; on a
    loaded machine their start-up probes made every other allocation look faster than the one in
    use, and a drift check moved the run from peer to peer (the demo beside two spinning
    processes: 0.368 s measured against 0.268 s predicted for two idle peers, twice in a minute).
    Peers of machines with no training peer, and peers without a host, keep theirs."""
    figures = np.asarray(view.compute_ms, dtype=float)
    share = np.asarray(view.compute_share, dtype=float)
    trained = np.isfinite(share) & np.isfinite(figures) & (figures > 0)
    if not trained.any():
        return view
    out = figures.copy()
    hosts = np.array(view.hosts, dtype=object)
    for host in set(h for h, t in zip(view.hosts, trained) if t and h):
        on = hosts == host
        floor = float(np.median(figures[on & trained]))
        idle = on & ~trained & np.isfinite(figures) & (figures > 0)
        out[idle] = np.maximum(figures[idle], floor)
    return replace(view, compute_ms=out)


def peer_compute(view: NetworkView, kind: Mapping[int, float] | None = None) -> PeerCompute:
    """Each view peer's compute speed from its reported reference-block time; `kind`: the run's
    layer's `kind_factors` (none: the reference rate)."""
    ms = np.asarray(view.compute_ms, dtype=float)
    known = np.isfinite(ms) & (ms > 0)
    factors = {int(b): float(f) for b, f in (kind or {}).items() if f > 0 and np.isfinite(f)}
    if not known.any():
        return PeerCompute(None, np.ones(len(ms)), 0, factors)
    median_ms = float(np.median(ms[known]))
    speeds = np.where(known, median_ms / np.where(known, ms, 1.0), 1.0)
    tflops = reference_block_flops() / (median_ms / 1e3) / 1e12
    return PeerCompute(tflops, speeds, int(known.sum()), factors)
