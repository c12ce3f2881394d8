"""The fastest shape of a run: every count of stages and pipelines the peers allow, spares
included, each searched with `solve` and simulated with the trainer's syncs; the shape the
simulator predicts fastest per step wins (the global batch is the run's whatever the shape, so
the fastest step is the fastest to the run's target).

A swarm's coordinator chooses a new run's shape this way (control/coordinator/schedule.py
`choose_shape`), and writes its inputs to a view file (`ScheduleInputs`, JSON) that
`dtfm-sched solve --view FILE` replays offline: the same search on the same inputs.

    found = solve_fastest(delay_ms, bandwidth_gbps, spec_of, shape_space(8, 4, 4), micro_batches=4)
    found.alloc, found.iteration_s, found.note(8)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from .compression import CompressionOptions
from .cost import CostModel
from .search import SearchConfig
from .simulate import simulate
from .solve import Allocation, solve
from .spec import ModelSpec, update_s_per_param

__all__ = ["FastestShape", "RunModel", "ScheduleInputs", "VIEW_FORMAT", "shape_space", "solve_fastest"]

VIEW_FORMAT = "dtfm-schedule-inputs-v1"
MAX_VIEW_BYTES = 64 << 20  # a view file's bound (a 1,000-peer view is about 30 MB of JSON)


def shape_space(n: int, layers: int, d_max: int, *, stages: int | None = None, dp: int | None = None,
                compute_costed: bool = True) -> list[tuple[int, int]]:
    """Every (S, D) a run may take on n peers: S divides the layers (an even split), S x D at
    most n (peers left out are spares), D at most `d_max` (each pipeline's micro-batches at
    least one sample); `stages` or `dp` fix one of the two; the widest D of each S first.
    Without `compute_costed` (no peer's compute known, so fewer peers would always look
    faster), only the widest D of each S and one fewer."""
    out = []
    for S in range(1, min(layers, n) + 1):
        if layers % S or (stages is not None and S != stages):
            continue
        widest = min(n // S, max(1, d_max))
        for D in range(widest, 0, -1):
            if (dp is None or D == dp) and (compute_costed or D >= widest - 1):
                out.append((S, D))
    return out


@dataclass(frozen=True)
class FastestShape:
    alloc: Allocation  # the fastest shape's allocation
    iteration_s: float  # its simulated iteration
    tried: tuple[tuple[int, int, float], ...]  # (S, D, simulated iteration) of every shape searched

    def note(self, n: int) -> str:
        """Why the shape, in one line: "4 x 1 (4 spares): predicted 0.412 s/step; every peer
        placed (4 x 2) 0.650 s; next 2 x 2 0.520 s (11 shapes tried)": the chosen shape, the
        best that places every peer when the chosen one leaves some out, the best of the rest."""
        S, D = self.alloc.stages, self.alloc.dp
        by = {(s, d): t for s, d, t in self.tried}
        spares = n - S * D
        out = f"{S} x {D}" + (f" ({spares} spare{'s' if spares != 1 else ''})" if spares else "")
        out += f": predicted {by.get((S, D), self.iteration_s):.3f} s/step"
        rest = sorted((t, s, d) for s, d, t in self.tried if (s, d) != (S, D))
        full = [x for x in rest if x[1] * x[2] == n]
        if spares and full:
            t, s, d = full[0]
            out += f"; every peer placed ({s} x {d}) {t:.3f} s"
            rest.remove(full[0])
        if rest:
            t, s, d = rest[0]
            out += f"; next {s} x {d} {t:.3f} s"
        k = len(self.tried)
        return out + f" ({k} shape{'s' if k != 1 else ''} tried)"


def solve_fastest(delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, spec_of: Callable[[int], ModelSpec],
                  shapes: Sequence[tuple[int, int]], *, micro_batches: int, compute: np.ndarray | None = None,
                  regions: Sequence[str] | None = None, seed: int = 0, time_budget_s: float = 5.0,
                  compression: CompressionOptions | None = None) -> FastestShape:
    """`solve` on each shape (`spec_of(D)`: the model for D pipelines, its compute term on when
    it has `reference_tflops`), the budget shared among the shapes; each result simulated with
    the trainer's syncs at `micro_batches`, compute at `compute` (per-peer speeds); the fastest
    wins (on a tie, the first). With many peers (the hierarchical search's range) the search
    costs no compute; the simulator still does. `compression`: the codecs the search may give
    each link and group (the simulation stays exact). ValueError when `shapes` is empty."""
    if not shapes:
        raise ValueError("no shape to search")
    n = np.asarray(delay_ms).shape[0]
    flat = n < SearchConfig().hierarchy_min_peers
    t0 = time.monotonic()
    tried: list[tuple[int, int, float]] = []
    best: tuple[float, Allocation] | None = None
    for k, (S, D) in enumerate(shapes):
        budget = max(time_budget_s - (time.monotonic() - t0), 0.0) / (len(shapes) - k)
        mspec = spec_of(D)
        costed = flat and compute is not None and mspec.reference_tflops is not None
        searched = mspec if costed or mspec.reference_tflops is None else _without_compute(mspec)
        alloc = solve(delay_ms, bandwidth_gbps, searched, stages=S, dp=D, regions=regions,
                      compute=compute if costed else None, time_budget_s=max(budget, 1e-9), seed=seed,
                      allow_spares=True, compression=compression)
        model = CostModel(delay_ms, bandwidth_gbps, mspec.workload(S, D), compute=compute)
        t = float(simulate(model, alloc.matrix, micro_batches=micro_batches, engine_syncs=True).iteration_s)
        tried.append((S, D, t))
        if best is None or t < best[0] - 1e-12:
            best = (t, alloc)
    assert best is not None
    return FastestShape(best[1], best[0], tuple(tried))


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
    micro_batches: int
    act_bytes: int = 2

    def spec(self, dp: int, reference_tflops: float | None = None, update_s_per_param: float = 0.0) -> ModelSpec:
        """The model for D = `dp` pipelines: micro-batches of global / (D x M) sequences; with
        `reference_tflops` its compute is costed, the output head's on the last stage too, and
        the optimizer's update at `update_s_per_param`."""
        mb = self.micro_batch(dp)
        return ModelSpec(self.name, layers=self.layers, hidden=self.hidden, heads=self.heads, seq_len=self.seq_len,
                         vocab=self.vocab, micro_batch_size=mb, global_batch_seqs=self.global_batch_seqs,
                         act_bytes=self.act_bytes, reference_tflops=reference_tflops,
                         head_compute=reference_tflops is not None, update_s_per_param=update_s_per_param)

    def micro_batch(self, dp: int) -> int:
        """Sequences per micro-batch of D = `dp` pipelines (the scheduler's count)."""
        return max(1, self.global_batch_seqs // (dp * self.micro_batches))

    @property
    def d_max(self) -> int:
        return max(1, self.global_batch_seqs // self.micro_batches)


@dataclass(frozen=True)
class ScheduleInputs:
    """What a coordinator scheduled a run's first placement on, and what it chose: the view's
    matrices (one-way ms, Gbps), each peer's compute speed relative to the median peer whose
    achieved TFLOP/s is `reference_tflops` (None: compute not costed), the run's layer's time
    per FLOP against the reference by micro-batch size (`kind`), the model, the asked shape
    (None: the scheduler's) and the search's seed and budget."""

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

    def tflops(self, micro_batch: int) -> float | None:
        if self.reference_tflops is None:
            return None
        return self.reference_tflops / self.kind.get(micro_batch, 1.0)

    def spec_of(self, dp: int) -> ModelSpec:
        return self.model.spec(dp, self.tflops(self.model.micro_batch(dp)),
                               update_s_per_param(self.kind, self.reference_tflops))

    def shapes(self) -> list[tuple[int, int]]:
        n = len(self.peers)
        out = shape_space(n, self.model.layers, self.model.d_max, stages=self.stages, dp=self.dp,
                          compute_costed=self.reference_tflops is not None)
        if self.reference_tflops is None and self.stages is None:
            out = [(S, D) for S, D in out if S * D == n] or out
        return out

    def solve(self, time_budget_s: float | None = None,
              compression: CompressionOptions | None = None) -> FastestShape:
        """The coordinator's search on these inputs (`choose_shape` runs it; `dtfm-sched solve
        --view` replays it). `compression`: the codecs the search may give links and groups."""
        return solve_fastest(self.delay_ms, self.bandwidth_gbps, self.spec_of, self.shapes(),
                             micro_batches=self.model.micro_batches,
                             compute=self.speeds if self.reference_tflops is not None else None,
                             regions=list(self.regions) if any(self.regions) else None, seed=self.seed,
                             time_budget_s=self.time_budget_s if time_budget_s is None else time_budget_s,
                             compression=compression)

    def to_json(self) -> str:
        d = {"format": VIEW_FORMAT, "peers": list(self.peers), "regions": list(self.regions),
             "delay_ms": np.asarray(self.delay_ms).tolist(),
             "bandwidth_gbps": [[None if not np.isfinite(v) else float(v) for v in row] for row in self.bandwidth_gbps],
             "speeds": np.asarray(self.speeds).tolist(), "reference_tflops": self.reference_tflops,
             "kind": {str(b): f for b, f in sorted(self.kind.items())}, "model": asdict(self.model),
             "stages": self.stages, "dp": self.dp, "seed": self.seed, "time_budget_s": self.time_budget_s,
             "chosen": dict(self.chosen)}
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
            return cls(tuple(map(str, d["peers"])), tuple(map(str, d["regions"])), delay, bw, speeds,
                       None if ref is None else float(ref), {int(b): float(f) for b, f in d["kind"].items()},
                       RunModel(**d["model"]), d["stages"], d["dp"], int(d["seed"]), float(d["time_budget_s"]),
                       dict(d.get("chosen", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None
