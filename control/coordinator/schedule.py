"""From the gossiped view to a placement: the scheduler's input for the model the swarm trains,
and its answer in peer ids (`Placement`). The protocol is in docs/control.md."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dtfm.gossip import NetworkView
from dtfm.sched import CostModel, ModelSpec, layer_ranges, simulate_iteration, solve
from dtfm.train import GPTSpec, TrainConfig

from .request import PLACEMENTS

__all__ = ["PLACEMENTS", "Placement", "choose_shape", "random_shape", "sched_spec", "view_matrices"]

# A speed-1.0 peer's achieved TFLOP/s, for turning a measured block time into the scheduler's
# compute term: only ratios between peers and against the network matter.
REFERENCE_TFLOPS = 1.0


@dataclass(frozen=True)
class Placement:
    """Who runs what (pipelines of peers, their layer ranges, the spares) and its prediction."""

    pipelines: tuple[tuple[bytes, ...], ...]  # [d][s]: peer id
    layer_ranges: tuple[tuple[int, int], ...]
    spares: tuple[bytes, ...]
    predicted_iteration_s: float  # the GPipe simulator on the measured view, with the trainer's syncs
    objective_s: float  # the paper's cost (DP + 2 x PP) of this allocation


def sched_spec(spec: GPTSpec, cfg: TrainConfig, dp: int) -> ModelSpec:
    """The scheduler's description of the model the trainer builds, for D pipelines."""
    mb = max(1, cfg.global_batch_seqs // (dp * cfg.micro_batches))
    act_bytes = 4 if cfg.wire_dtype == "float32" else 2
    return ModelSpec(spec.name, layers=spec.n_layer, hidden=spec.n_embd, heads=spec.n_head,
                     seq_len=spec.seq_len, vocab=spec.vocab, micro_batch_size=mb,
                     global_batch_seqs=cfg.global_batch_seqs, act_bytes=act_bytes)


def choose_shape(view: NetworkView, spec: GPTSpec, cfg: TrainConfig, *, stages: int | None, dp: int | None,
                 regions: dict[bytes, str] | None = None, time_budget_s: float = 5.0,
                 seed: int = 0) -> Placement:
    """Run the DT-FM scheduler on the view. stages=None picks the shape too ("auto").

    ValueError when the view is incomplete or the shape does not fit the live peers."""
    n = len(view.peers)
    if not view.complete:
        raise ValueError(f"the network view is incomplete ({view.pairs_known()} of {n * (n - 1)} links "
                         "measured): wait until gossip has measured every link")
    delay, bw = view_matrices(view)
    labels = [regions.get(p, "") for p in view.peers] if regions else None
    d_for_spec = dp or max(1, n // (stages or 1))
    mspec = sched_spec(spec, cfg, d_for_spec)
    alloc = solve(delay, bw, mspec, stages="auto" if stages is None else stages, dp=dp, regions=labels,
                  time_budget_s=time_budget_s, seed=seed, allow_spares=stages is not None)
    model = CostModel(delay, bw, sched_spec(spec, cfg, alloc.dp).workload(alloc.stages, alloc.dp))
    sim = simulate_iteration(model, alloc.matrix, micro_batches=cfg.micro_batches, engine_syncs=True)
    ids = view.peers
    return Placement(tuple(tuple(ids[i] for i in pipe) for pipe in alloc.pipelines), alloc.layer_ranges,
                     tuple(ids[i] for i in alloc.spares), float(sim.iteration_s), float(alloc.cost.paper_s))


def random_shape(view: NetworkView, spec: GPTSpec, cfg: TrainConfig, *, stages: int, dp: int,
                 seed: int = 0) -> Placement:
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
    model = CostModel(delay, bw, sched_spec(spec, cfg, dp).workload(stages, dp))
    sim = simulate_iteration(model, X, micro_batches=cfg.micro_batches, engine_syncs=True)
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
