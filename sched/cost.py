"""The DT-FM cost model (COSTMODEL.md) on matrices, plus the optional compute and memory terms.

An allocation is held as an (S, D) integer array X: X[s, p] is the peer running stage s of
pipeline p; row s is the DP group of stage s. The paper objective is

    DPcost + 2 * PPcost,  DPcost = max_s max_{i in G_s} sum_{j in G_s} 2 (a_ij + c_grad / (D b_ij)),
                          PPcost = sum_s max_p a + c_act / b  over the hop P[p][s] -> P[p][s+1].

The extensions, each off unless its inputs are given:
- compute: a stage runs at the speed of its slowest member; an iteration of GPipe takes
  (M + S - 1) times the slowest stage's time per micro-batch, plus the slowest update (the
  optimizer on a stage's parameters, `Workload.update_s_per_param`).
- memory: a peer holds no more layers than fit; a shortfall is a penalty, not a crash.
- uneven layers: stages may hold different layer counts, faster groups more; a stage's gradient
  volume follows its layer count.
- compression (`CompressionOptions` with more than exact): a pipeline link costs the cheapest of
  its allowed codecs, hop_c = a + r_c c_act / b + coding (r_c the codec's payload / exact bytes
  at the message size, coding the encode and decode time of c_act's elements); a DP group costs
  the cheapest allowed codec's, each member's row sum_j (a_ij + P / b_ij) + coding for an
  all-gather of payloads of P bytes, divided by the codec's period (DiLoCo synchronises every H
  steps: its traffic is amortised). Exact-only options give exactly the paper's matrices.
  Coding runs at `options.speed` on every peer, or at each peer's own figure when
  `options.peer_speeds` gives one per peer: a link's encode on its sender, its decode on its
  receiver (a link carries activations one way and their gradients back, so its hop counts
  the mean of the two directions' coding), a DP member's on that member.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .compression import CodecAssignment, CompressionOptions, DataParallelCodec, PipelineCodec
from .layers import split_layers
from .spec import Workload

__all__ = ["CostModel", "CostBreakdown", "INFEASIBLE_PENALTY_S", "nearly_symmetric", "paper_breakdown"]

# Cost added per layer that does not fit in memory: large enough that any feasible allocation wins.
INFEASIBLE_PENALTY_S = 1e4


def nearly_symmetric(m: np.ndarray) -> bool:
    """np.allclose(m, m.T) for finite matrices, without its general (inf, nan) handling: a
    third of the time on the large matrices the search checks."""
    return bool(np.all(np.abs(m - m.T) <= 1e-8 + 1e-5 * np.abs(m.T)))


@dataclass(frozen=True)
class CostBreakdown:
    dp_s: float  # the paper's DPcost
    pp_s: float  # the paper's PPcost (one direction)
    compute_s: float  # the compute term; 0 when compute is off
    penalty_s: float  # memory shortfall penalty; 0 when every stage fits
    layers: tuple[int, ...]  # layers per stage, in stage order
    dp_stage_s: tuple[float, ...] = field(default=(), repr=False)  # DP cost of each stage's group
    boundary_s: tuple[float, ...] = field(default=(), repr=False)  # bottleneck hop of each boundary

    @property
    def paper_s(self) -> float:
        """DPcost + 2 PPcost: the objective of the paper, whatever the extensions."""
        return self.dp_s + 2 * self.pp_s

    @property
    def total_s(self) -> float:
        """The objective the search minimises: the paper's plus the enabled extensions."""
        return self.paper_s + self.compute_s + self.penalty_s

    @property
    def feasible(self) -> bool:
        return self.penalty_s == 0


class CostModel:
    """Cost of allocations on one network for one workload.

    delay_ms and bandwidth_gbps are (N, N) in scenario units (one-way ms, Gbps, bandwidth
    infinite or ignored on the diagonal). compute: per-peer relative speed (1.0 = the speed the
    workload's layer_compute_s refers to). memory_gib: per-peer memory.
    """

    def __init__(self, delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, workload: Workload, *,
                 compute: np.ndarray | None = None, memory_gib: np.ndarray | None = None,
                 uneven_layers: bool = False, compression: CompressionOptions | None = None) -> None:
        delay_ms = np.asarray(delay_ms, dtype=float)
        bandwidth_gbps = np.asarray(bandwidth_gbps, dtype=float)
        n = delay_ms.shape[0]
        if delay_ms.shape != (n, n) or bandwidth_gbps.shape != (n, n):
            raise ValueError("delay and bandwidth must be square matrices of the same size")
        if np.any(delay_ms < 0) or np.any(np.isnan(delay_ms)):
            raise ValueError("delays must be non-negative")
        off = ~np.eye(n, dtype=bool)
        if np.any(~(bandwidth_gbps[off] > 0)):
            raise ValueError("bandwidths must be positive")
        self.n = n
        self.workload = wl = workload
        a = delay_ms / 1e3
        inv_b = np.zeros((n, n))
        inv_b[off] = 8.0 / bandwidth_gbps[off]  # seconds per GB
        a[~off] = 0.0
        self.lat_s = a  # (N, N) one-way latency, seconds
        self.s_per_gb = inv_b  # (N, N) transfer time of one GB, seconds
        # the same as the simulator has always computed it (through the DP pair cost), so its
        # predictions stay identical to the last bit
        self.sim_s_per_gb = np.where(off, 2 * inv_b / wl.dp * wl.dp / 2, 0.0)
        self.options = opts = compression or CompressionOptions()
        if opts.peer_speeds and len(opts.peer_speeds) != n:
            raise ValueError(f"compression options give codec speeds of {len(opts.peer_speeds)} peers, "
                             f"the network has {n}")
        self._dp_coef: dict[DataParallelCodec, tuple[np.ndarray, np.ndarray]] = {}
        self._pp_coding: dict[PipelineCodec, tuple[np.ndarray, np.ndarray]] = {}
        if len(opts.pp) == 1:
            self.hop = a + wl.act_gb * inv_b  # (N, N) one boundary hop, seconds
            self.pp_choice = np.zeros((n, n), dtype=np.int64)
        else:  # every link takes its cheapest allowed codec; on a tie the least lossy (first)
            hops = np.stack([self.link_hop(c) for c in opts.pp])
            self.pp_choice = hops.argmin(axis=0)
            self.hop = hops.min(axis=0)
        if len(opts.dp) == 1:
            self.dp_a = 2 * a  # DP pair cost = dp_a + grad_gb * dp_b
            self.dp_b = 2 * inv_b / wl.dp
        else:  # a screen for the search: each pair's cheapest codec at the even split's gradient
            g0 = self.uniform_grad_gb()
            coefs = [self.dp_coefficients(c) for c in opts.dp]
            pick = np.stack([ca + g0 * cb for ca, cb in coefs]).argmin(axis=0)
            self.dp_a = np.choose(pick, [ca for ca, _ in coefs])
            self.dp_b = np.choose(pick, [cb for _, cb in coefs])
        self.compute = None if compute is None else np.asarray(compute, dtype=float)
        self.memory = None if memory_gib is None else np.asarray(memory_gib, dtype=float)
        for name, v in (("compute", self.compute), ("memory_gib", self.memory)):
            if v is not None and (v.shape != (n,) or np.any(~(v > 0))):
                raise ValueError(f"{name} must be {n} positive numbers")
        self.uneven_layers = uneven_layers
        self.memory_on = self.memory is not None and wl.layer_memory_gib is not None
        self.compute_on = wl.layer_compute_s is not None
        self.speed = self.compute if self.compute is not None else np.ones(n)
        if self.memory is not None and wl.layer_memory_gib is not None:  # memory_on
            room = (self.memory - wl.base_memory_gib) / wl.layer_memory_gib
            self.layer_cap = np.floor(np.maximum(room, 0) + 1e-9).astype(np.int64)
        else:
            self.layer_cap = np.full(n, wl.layers, dtype=np.int64)
        # The fast search path is exact only for the paper objective with an even split (and one
        # DP codec: with several, a group's cost is the best codec's, which its pairs only screen).
        self.extensions = (self.compute_on or self.memory_on or uneven_layers or not wl.uniform_layers
                           or len(opts.dp) > 1)

    # -- compression ----------------------------------------------------------------------
    def pp_messages(self) -> tuple[int, int]:
        """(messages per link per direction per iteration, elements per message)."""
        wl = self.workload
        total = wl.act_gb * 1e9 / wl.act_elem_bytes
        return wl.micro_batches, max(1, round(total / wl.micro_batches))

    def pp_ratio(self, codec: PipelineCodec) -> float:
        """Bytes `codec` puts on a pipeline link per exact byte, at this workload's message size."""
        if codec.exact:
            return 1.0
        _, numel = self.pp_messages()
        eb = self.workload.act_elem_bytes
        return codec.payload_bytes(numel, eb) / (numel * eb)

    def pp_coding_s(self, codec: PipelineCodec) -> tuple[float, float]:
        """(encode, decode) seconds per message of `codec` at the options' common `speed`."""
        enc, dec = codec.coding_ns_per_elem(self.options.speed)
        _, numel = self.pp_messages()
        return numel * enc * 1e-9, numel * dec * 1e-9

    def peer_pp_coding_s(self, codec: PipelineCodec) -> tuple[np.ndarray, np.ndarray]:
        """(N,) encode and (N,) decode seconds per message of `codec` on each peer (its own
        speed where the options give per-peer speeds, else the common one)."""
        if codec not in self._pp_coding:
            if not self.options.peer_speeds:
                enc, dec = self.pp_coding_s(codec)
                self._pp_coding[codec] = np.full(self.n, enc), np.full(self.n, dec)
            else:
                _, numel = self.pp_messages()
                ns = np.array([codec.coding_ns_per_elem(sp) for sp in self.options.peer_speeds])  # (N, 2)
                self._pp_coding[codec] = numel * ns[:, 0] * 1e-9, numel * ns[:, 1] * 1e-9
        return self._pp_coding[codec]

    def link_hop(self, codec: PipelineCodec) -> np.ndarray:
        """(N, N) one boundary hop of one iteration, one direction, every link coding with `codec`."""
        wl = self.workload
        if codec.exact:
            return self.lat_s + wl.act_gb * self.s_per_gb
        m, _ = self.pp_messages()
        off = ~np.eye(self.n, dtype=bool)
        wire = self.lat_s + wl.act_gb * self.pp_ratio(codec) * self.s_per_gb
        enc_v, dec_v = self.peer_pp_coding_s(codec)
        forward = enc_v[:, None] + dec_v[None, :]  # [i, j]: i encodes, j decodes
        return wire + off * (m * (forward + forward.T) / 2)  # the mean of the two directions

    def dp_ratio(self, codec: DataParallelCodec) -> tuple[float, float]:
        """(payload bytes per exact gradient byte, candidates per parameter) of `codec` at the
        even split's stage size; a stage of another size scales linearly (chunk rounding aside)."""
        if codec.exact:
            return 1.0, 1.0
        wl = self.workload
        numel = round(self.uniform_grad_gb() * 1e9 / wl.grad_elem_bytes)
        if numel < 1:
            return 0.0, 0.0
        return codec.payload_bytes(numel) / (numel * wl.grad_elem_bytes), codec.candidates(numel) / numel

    def dp_coefficients(self, codec: DataParallelCodec, *, amortised: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(A, B): a member's DP cost towards each other member is A + stage gradient GB x B, for
        one synchronisation, or (amortised) per iteration."""
        if codec not in self._dp_coef:
            D = self.workload.dp
            if codec.exact:
                A, B = 2 * self.lat_s, 2 * self.s_per_gb / D
            else:
                ratio, cand = self.dp_ratio(codec)
                off = ~np.eye(self.n, dtype=bool)
                A = self.lat_s.copy()
                speeds = self.options.peer_speeds or (self.options.speed,) * self.n
                ns = np.array([codec.coding_ns_per_elem(sp, D) for sp in speeds])  # (N,) each member's own
                per_gb = 1e9 / self.workload.grad_elem_bytes * cand * ns * 1e-9
                B = ratio * self.s_per_gb + off * (per_gb[:, None] / max(D - 1, 1))  # row i: spread over i's D - 1 pairs
            self._dp_coef[codec] = (A, B)
        A, B = self._dp_coef[codec]
        p = codec.period_steps
        return (A / p, B / p) if amortised and p > 1 else (A, B)

    def dp_rows_codec(self, X: np.ndarray, layers: np.ndarray, codec: DataParallelCodec, *,
                      amortised: bool = True) -> np.ndarray:
        """(S, D) DP cost of every member of every group, every group coding with `codec`."""
        A, B = self.dp_coefficients(codec, amortised=amortised)
        g = np.array([self.workload.grad_gb(c) for c in layers])
        return A[X[:, :, None], X[:, None, :]].sum(axis=2) + g[:, None] * B[X[:, :, None], X[:, None, :]].sum(axis=2)

    def dp_groups(self, X: np.ndarray, layers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(S,) DP cost per iteration of each group with its cheapest allowed codec, and (S,) that
        codec's index in the options (the first on a tie)."""
        if len(self.options.dp) == 1:
            return self.dp_rows(X, layers).max(axis=1), np.zeros(X.shape[0], dtype=np.int64)
        costs = np.stack([self.dp_rows_codec(X, layers, c).max(axis=1) for c in self.options.dp])
        return costs.min(axis=0), costs.argmin(axis=0)

    def assignment(self, X: np.ndarray) -> CodecAssignment:
        """The codecs this model costs allocation X with: each link's and group's cheapest."""
        X = np.asarray(X, dtype=np.int64)
        layers, _ = self.group_layers(X)
        _, dp_pick = self.dp_groups(X, layers)
        pp = self.pp_choice[X[:-1], X[1:]]
        return CodecAssignment(tuple(tuple(self.options.pp[k] for k in row) for row in pp),
                               tuple(self.options.dp[k] for k in dp_pick))

    # -- per-group quantities -------------------------------------------------------------
    def group_layers(self, X: np.ndarray) -> tuple[np.ndarray, int]:
        """Layers per group (row of X) and the memory shortfall in layers."""
        S = X.shape[0]
        wl = self.workload
        caps = self.layer_cap[X].min(axis=1)
        if self.uneven_layers:
            speeds = self.speed[X].min(axis=1) if self.compute_on else np.ones(S)
            return split_layers(wl.layers, speeds, caps)
        counts, _ = split_layers(wl.layers, np.ones(S), np.full(S, wl.layers))
        return counts, int(np.maximum(counts - caps, 0).sum())

    def dp_rows(self, X: np.ndarray, layers: np.ndarray) -> np.ndarray:
        """(S, D) DP cost of every member of every group."""
        g = np.array([self.workload.grad_gb(c) for c in layers])
        A = self.dp_a[X[:, :, None], X[:, None, :]].sum(axis=2)
        B = self.dp_b[X[:, :, None], X[:, None, :]].sum(axis=2)
        return A + g[:, None] * B

    def hops(self, X: np.ndarray) -> np.ndarray:
        """(S-1, D) hop time of every pipeline at every boundary."""
        return self.hop[X[:-1], X[1:]]

    def compute_time(self, X: np.ndarray, layers: np.ndarray) -> float:
        if not self.compute_on:
            return 0.0
        wl = self.workload
        slowest = self.speed[X].min(axis=1)
        per_mb = wl.compute_layers(layers) * wl.layer_compute_s / slowest
        return float((wl.micro_batches + X.shape[0] - 1) * per_mb.max() + (wl.update_s(layers) / slowest).max())

    def breakdown(self, X: np.ndarray) -> CostBreakdown:
        X = np.asarray(X, dtype=np.int64)
        layers, shortfall = self.group_layers(X)
        dp_stage, _ = self.dp_groups(X, layers)
        bound = self.hops(X).max(axis=1) if X.shape[0] > 1 else np.zeros(0)
        return CostBreakdown(
            dp_s=float(dp_stage.max()), pp_s=float(bound.sum()),
            compute_s=self.compute_time(X, layers), penalty_s=INFEASIBLE_PENALTY_S * shortfall,
            layers=tuple(int(c) for c in layers),
            dp_stage_s=tuple(float(v) for v in dp_stage), boundary_s=tuple(float(v) for v in bound))

    def total(self, X: np.ndarray) -> float:
        return self.breakdown(X).total_s

    def uniform_grad_gb(self) -> float:
        wl = self.workload
        return wl.grad_gb(wl.layers / wl.stages)



def paper_breakdown(delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, workload: Workload, X: np.ndarray) -> CostBreakdown:
    """The paper objective of allocation X, reading only the links it uses: each DP group's
    D x D block and each boundary's D hops. For networks too large for a `CostModel` (which holds
    several N x N matrices); the matrices may be float32 or memory-mapped. The same arithmetic as
    `CostModel.breakdown` (bit for bit on float64 inputs and an X of the same memory layout) for
    an even split without extensions."""
    X = np.asarray(X, dtype=np.int64)
    S, D = X.shape
    wl = workload
    if not wl.uniform_layers or S != wl.stages or D != wl.dp:
        raise ValueError(f"paper_breakdown needs the workload's shape {wl.stages} x {wl.dp} with an even split, "
                         f"got {S} x {D}")
    g = np.full(S, wl.grad_gb(wl.layers // S))
    a, inv_b = _link_blocks(delay_ms, bandwidth_gbps, (X[:, :, None], X[:, None, :]))  # (S, D, D)
    A = (2 * a).sum(axis=2)
    B = (2 * inv_b / D).sum(axis=2)
    dp_stage = (A + g[:, None] * B).max(axis=1)
    if S > 1:
        a, inv_b = _link_blocks(delay_ms, bandwidth_gbps, (X[:-1], X[1:]))
        bound = (a + wl.act_gb * inv_b).max(axis=1)
    else:
        bound = np.zeros(0)
    return CostBreakdown(dp_s=float(dp_stage.max()), pp_s=float(bound.sum()), compute_s=0.0, penalty_s=0.0,
                         layers=tuple([wl.layers // S] * S), dp_stage_s=tuple(float(v) for v in dp_stage),
                         boundary_s=tuple(float(v) for v in bound))


def _link_blocks(delay_ms: np.ndarray, bandwidth_gbps: np.ndarray,
                 ix: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(latency s, seconds per GB) of the links indexed by ix, as the cost model computes them:
    zero on a peer's link to itself."""
    a = np.asarray(delay_ms[ix], dtype=float) / 1e3  # indexed as the model gathers, so sums add up alike
    bw = np.asarray(bandwidth_gbps[ix], dtype=float)
    same = np.broadcast_to(ix[0] == ix[1], a.shape)
    inv_b = np.zeros_like(a)
    inv_b[~same] = 8.0 / bw[~same]
    a[same] = 0.0
    return a, inv_b
