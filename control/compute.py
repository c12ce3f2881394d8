"""Each peer's compute speed, as the scheduler reads it and as a peer measures it.

A peer reports `compute_ms` in its signed gossip report: the forward and backward time, in ms,
of gossip's reference block (`dtfm.gossip.REFERENCE_BLOCK`: a transformer block of width 256,
4 heads, 128 tokens, batch 4). It probes the block once at start; once it trains a stage, its
own steps measure it better (the stage's real layers at the run's micro-batch, on a machine as
loaded as it is): `ComputeGauge` turns the compute seconds of its last steps into the same
unit, and the daemon reports that instead (`GossipService.set_compute_ms`).

The scheduler turns the figures into its compute term (`peer_compute`): the median reporting
peer's achieved TFLOP/s on the reference block is the speed-1.0 peer (`reference_tflops`), each
peer's speed is the median's time over its own (a peer without a figure is taken at 1.0), and
`sched_spec` describes the model at that speed, the output head's compute on the last stage
included. The time per layer follows each stage's FLOPs at the run's micro-batch.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

from dtfm.gossip import REFERENCE_BLOCK, NetworkView
from dtfm.sched import ModelSpec
from dtfm.train import GPTSpec, TrainConfig

__all__ = ["ComputeGauge", "GAUGE_SKIP_STEPS", "GAUGE_STEPS", "PeerCompute", "peer_compute", "reference_block_flops",
           "sched_spec", "training_block_ms"]

GAUGE_STEPS = 8  # steps whose median a training peer reports
GAUGE_SKIP_STEPS = 2  # an epoch's first steps left out (allocation, caches and the first sends warm up)


def sched_spec(spec: GPTSpec, cfg: TrainConfig, dp: int, *, reference_tflops: float | None = None) -> ModelSpec:
    """The scheduler's description of the model the trainer builds, for D pipelines; with
    `reference_tflops` (a speed-1.0 peer's achieved TFLOP/s) its compute is costed, the output
    head on the last stage included; without, compute is free."""
    mb = max(1, cfg.global_batch_seqs // (dp * cfg.micro_batches))
    act_bytes = 4 if cfg.wire_dtype == "float32" else 2
    return ModelSpec(spec.name, layers=spec.n_layer, hidden=spec.n_embd, heads=spec.n_head,
                     seq_len=spec.seq_len, vocab=spec.vocab, micro_batch_size=mb,
                     global_batch_seqs=cfg.global_batch_seqs, act_bytes=act_bytes,
                     reference_tflops=reference_tflops, head_compute=reference_tflops is not None)


def reference_block_flops() -> float:
    """Forward and backward FLOPs of the reference block, counted as the scheduler counts a layer's."""
    width, heads, seq_len, batch = REFERENCE_BLOCK
    return ModelSpec("reference", 1, width, heads, seq_len, 1, batch, batch).layer_flops()


def training_block_ms(spec: GPTSpec, cfg: TrainConfig, dp: int, layers: int, last_stage: bool,
                      compute_s: float) -> float | None:
    """The reference block's time on a peer whose stage of `layers` layers (the last stage:
    with the output head) computed for `compute_s` seconds in one step of a run of D = `dp`
    pipelines; None for a figure that says nothing (no layers, no time)."""
    if layers < 1 or not compute_s > 0:
        return None
    mspec = sched_spec(spec, cfg, dp)
    work = cfg.micro_batches * (layers + (mspec.head_layers_equivalent() if last_stage else 0.0)) * mspec.layer_flops()
    return compute_s * 1000.0 * reference_block_flops() / work


class ComputeGauge:
    """A training peer's compute figure: the median reference-block time of its stage's last
    GAUGE_STEPS steps, an epoch's first GAUGE_SKIP_STEPS left out."""

    def __init__(self) -> None:
        self._epoch: tuple[bytes, int] | None = None
        self._seen = 0
        self._figures: deque[float] = deque(maxlen=GAUGE_STEPS)

    def add(self, run_epoch: tuple[bytes, int], figure: float | None) -> float | None:
        """One step's figure (`training_block_ms`) of (run, epoch); the median once there are
        at least three, else None."""
        if run_epoch != self._epoch:
            self._epoch, self._seen = run_epoch, 0
        self._seen += 1
        if figure is None or self._seen <= GAUGE_SKIP_STEPS:
            return None
        self._figures.append(figure)
        return statistics.median(self._figures) if len(self._figures) >= 3 else None


@dataclass(frozen=True)
class PeerCompute:
    """The scheduler's compute inputs for the peers of a view."""

    reference_tflops: float | None  # the median reporting peer's achieved TFLOP/s; None: no peer reported
    speeds: np.ndarray  # (N,) each peer's speed relative to it; 1.0 for a peer without a figure
    known: int  # peers with a figure

    def describe(self) -> str:
        if self.reference_tflops is None:
            return "compute not costed (no peer reported its speed)"
        n = len(self.speeds)
        spread = f", speeds {self.speeds.min():.2f}-{self.speeds.max():.2f}" if n > 1 else ""
        return (f"compute at {self.reference_tflops * 1e3:.1f} GFLOP/s per peer (median of {self.known}/{n} "
                f"measured{spread})")


def peer_compute(view: NetworkView) -> PeerCompute:
    """Each view peer's compute speed from its reported reference-block time."""
    ms = np.asarray(view.compute_ms, dtype=float)
    known = np.isfinite(ms) & (ms > 0)
    if not known.any():
        return PeerCompute(None, np.ones(len(ms)), 0)
    median_ms = float(np.median(ms[known]))
    speeds = np.where(known, median_ms / np.where(known, ms, 1.0), 1.0)
    tflops = reference_block_flops() / (median_ms / 1e3) / 1e12
    return PeerCompute(tflops, speeds, int(known.sum()))
