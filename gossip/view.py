"""The N x N network view built from measurement reports, in scenario units.

Where both ends measured a link, the view combines them robustly. Each peer gets a bias: the
median, over its links measured from both ends, of log(its figure / the other end's figure).
An honest peer's bias is near zero; a peer that scales its reports about its own links by f
has a bias near log f. When both ends' biases are within `bias_threshold`, the view takes the
geometric mean of the two figures (always between them); otherwise it takes the figure of the
end with the smaller bias, so a liar cannot move the estimate off the honest end's figure.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from .records import Report

__all__ = ["NetworkView", "build_view"]

DEFAULT_BIAS_THRESHOLD = math.log(1.5)


@dataclass(frozen=True)
class NetworkView:
    peers: tuple[bytes, ...]
    delay_ms: np.ndarray  # (N, N) one-way (half the round trip); 0 on the diagonal, nan unknown
    bandwidth_gbps: np.ndarray  # (N, N); inf on the diagonal, nan unknown
    compute_ms: np.ndarray  # (N,) reference block forward+backward; nan unknown
    complete: bool  # every pair has a latency and a bandwidth from at least one end

    def pairs_known(self) -> int:
        off = ~np.eye(len(self.peers), dtype=bool)
        return int(np.sum(off & np.isfinite(self.delay_ms) & np.isfinite(self.bandwidth_gbps)))

    def unscaled(self, time_scale: float = 1.0, bandwidth_scale: float = 1.0) -> "NetworkView":
        """Divide an emulator's scales out: measured figures back in scenario units (the
        emulator multiplies delays by time_scale and bandwidth by bandwidth_scale / time_scale)."""
        return NetworkView(self.peers, self.delay_ms / time_scale,
                           self.bandwidth_gbps * time_scale / bandwidth_scale, self.compute_ms,
                           self.complete)

    def as_dict(self) -> dict:
        def clean(a):
            return [[None if not np.isfinite(x) else float(x) for x in row] for row in a]
        return {"peers": [p.hex() for p in self.peers], "delay_ms": clean(self.delay_ms),
                "bandwidth_gbps": clean(self.bandwidth_gbps), "complete": self.complete}


def _row_bias(m: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.log(m / m.T)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # rows without any pair: nan
        bias = np.nanmedian(np.where(np.isfinite(ratio), ratio, np.nan), axis=1)
    return np.where(np.isfinite(bias), bias, 0.0)


def combine(m: np.ndarray, threshold: float) -> np.ndarray:
    """Symmetric estimate from one-sided measurements m[i, j] (nan: not measured)."""
    bias = np.abs(_row_bias(m))
    a, b = m, m.T
    both = np.isfinite(a) & np.isfinite(b)
    with np.errstate(invalid="ignore"):
        geo = np.sqrt(a * b)
    trusted_i = bias[:, None] <= threshold
    trusted_j = bias[None, :] <= threshold
    pick_i = bias[:, None] < bias[None, :]
    pick_j = bias[None, :] < bias[:, None]
    out = np.where(both & trusted_i & trusted_j, geo,
          np.where(both & pick_i, a, np.where(both & pick_j, b, np.where(both, geo, np.nan))))
    out = np.where(~both & np.isfinite(a), a, out)
    out = np.where(~both & np.isfinite(b), b, out)
    return out


def build_view(peers, reports: dict[bytes, Report], *,
               bias_threshold: float = DEFAULT_BIAS_THRESHOLD) -> NetworkView:
    peers = tuple(peers)
    index = {p: i for i, p in enumerate(peers)}
    n = len(peers)
    rtt = np.full((n, n), np.nan)
    bw = np.full((n, n), np.nan)
    compute = np.full(n, np.nan)
    for measurer, r in reports.items():
        i = index.get(measurer)
        if i is None:
            continue
        if r.compute_ms > 0:
            compute[i] = r.compute_ms
        for e in r.entries:
            j = index.get(e.target)
            if j is None:
                continue
            rtt[i, j] = e.rtt_ms
            if e.bandwidth_gbps > 0:
                bw[i, j] = e.bandwidth_gbps
    delay = combine(rtt, bias_threshold) / 2.0
    band = combine(bw, bias_threshold)
    np.fill_diagonal(delay, 0.0)
    np.fill_diagonal(band, np.inf)
    complete = bool(np.all(np.isfinite(delay)) and np.all(~np.isnan(band)))
    return NetworkView(peers, delay, band, compute, complete)
