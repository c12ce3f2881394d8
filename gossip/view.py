"""The N x N network view built from measurement reports, in scenario units.

A member can only affect links it is an end of, and there only pessimistically:

- Link (a, b) is described by a's report (its entry for b) and b's report (its entry for a),
  nothing else. A report counts only under the measurer that signed it, so no third member
  can speak for the link.
- When both ends measured it, the view takes the worse figure: the higher round trip, the
  lower bandwidth. When the two differ by more than `tolerance` (a ratio), the link is
  `disputed`. Honest ends agree within their measurement noise, so the worse figure costs
  at most that noise; a mean would let a liar pull the honest figure towards its own.
- When one end measured it, the view takes that end's figure and marks the link `one_sided`.

So, for a link an honest end has measured, the view's delay is at least that end's and its
bandwidth at most that end's: lying can only make the liar's own links look worse, which
pushes work away from it, never towards it. A link between two honest members stays between
their two measurements. What a member says about its own compute speed and its coding speed
(`codec_ns`, ns per element of each codec: see records.py) is its own claim.

Links that neither end measured are estimated (`estimate=True`), from the two ends' own
claims only: the delay from their network coordinates (half the round trip the two
coordinates predict), the bandwidth as the lower of the two ends' capacities
(min(up_a, down_b, up_b, down_a): the view is symmetric). A member's claims thus reach only
its own links, as its measurements do; but an estimate may be optimistic where a
measurement cannot, so the view marks each figure `delay_measured` / `bandwidth_measured`,
with the age of the measured ones (`age_s`), and the control plane measures the links of a
plan before it hands the plan out (`GossipService.confirm`): a measured figure always
replaces the estimate.
"""

from __future__ import annotations

import math

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .records import CODEC_NS_LEN, Report
from .vivaldi import Coordinate

__all__ = ["NetworkView", "build_view", "DISAGREEMENT_RATIO"]

# Two ends' figures of one link further apart than this ratio flag the link as disputed.
# Honest round trips (medians of pings) and timed transfers agree far closer; the figure the
# view takes does not depend on it, only the flag does.
DISAGREEMENT_RATIO = 1.5

_NO_FLAGS = np.zeros((0, 0), dtype=bool)  # a NetworkView's flag matrix left out
_NO_CODEC = np.zeros((0, CODEC_NS_LEN))  # a NetworkView's coding speeds left out
_NO_AGES = np.zeros((0, 0))  # a NetworkView's ages left out
_NO_SHARES = np.zeros(0)  # a NetworkView's compute shares left out


@dataclass(frozen=True)
class NetworkView:
    peers: tuple[bytes, ...]
    delay_ms: np.ndarray  # (N, N) one-way (half the round trip); 0 on the diagonal, nan unknown
    bandwidth_gbps: np.ndarray  # (N, N); inf on the diagonal, nan unknown
    compute_ms: np.ndarray  # (N,) reference block forward+backward; nan unknown
    complete: bool  # every pair has a latency and a bandwidth from at least one end
    # (N, N) bool flags; left out (an empty matrix): all false
    disputed: np.ndarray = field(default_factory=lambda: _NO_FLAGS)  # the two ends disagree beyond the tolerance
    one_sided: np.ndarray = field(default_factory=lambda: _NO_FLAGS)  # a figure comes from one end only
    # (N, CODEC_NS_LEN) each peer's own coding speed, ns per element; a row of nan: unknown
    # (left out: all unknown)
    codec_ns: np.ndarray = field(default_factory=lambda: _NO_CODEC)
    # (N, N) bool: the figure comes from a measurement of that link (else it is estimated, or
    # unknown where nan); left out: every known figure counts as measured
    delay_measured: np.ndarray = field(default_factory=lambda: _NO_FLAGS)
    bandwidth_measured: np.ndarray = field(default_factory=lambda: _NO_FLAGS)
    # (N, N) seconds since the link was measured (the older end's figure); nan: not measured
    # (left out: all unknown)
    age_s: np.ndarray = field(default_factory=lambda: _NO_AGES)
    # (N,) the machine each peer runs on (its reports' `host`); b"": unknown (left out: all unknown)
    hosts: tuple[bytes, ...] = ()
    # (N,) the share of a core each peer's compute figure was measured with (its reports'
    # `compute_share`: CPU time over wall time in its training steps); nan: unknown (left out:
    # all unknown)
    compute_share: np.ndarray = field(default_factory=lambda: _NO_SHARES)

    def __post_init__(self) -> None:
        n = len(self.peers)
        if self.compute_share is _NO_SHARES:
            object.__setattr__(self, "compute_share", np.full(n, np.nan))
        if np.shape(self.compute_share) != (n,):
            raise ValueError(f"compute_share must name {n} peers, got {np.shape(self.compute_share)}")
        if not self.hosts:
            object.__setattr__(self, "hosts", (b"",) * n)
        if len(self.hosts) != n:
            raise ValueError(f"hosts must name {n} machines, got {len(self.hosts)}")
        for name in ("disputed", "one_sided"):
            if getattr(self, name) is _NO_FLAGS:
                object.__setattr__(self, name, np.zeros((n, n), dtype=bool))
        off = ~np.eye(n, dtype=bool)
        if self.delay_measured is _NO_FLAGS:
            object.__setattr__(self, "delay_measured", off & np.isfinite(self.delay_ms))
        if self.bandwidth_measured is _NO_FLAGS:
            object.__setattr__(self, "bandwidth_measured", off & ~np.isnan(self.bandwidth_gbps))
        if self.age_s is _NO_AGES:
            object.__setattr__(self, "age_s", np.full((n, n), np.nan))
        if self.codec_ns is _NO_CODEC:
            object.__setattr__(self, "codec_ns", np.full((n, CODEC_NS_LEN), np.nan))
        if np.shape(self.codec_ns) != (n, CODEC_NS_LEN):
            raise ValueError(f"codec_ns must be {n} x {CODEC_NS_LEN}, got {np.shape(self.codec_ns)}")

    def codec_known(self) -> np.ndarray:
        """(N,) bool: whether each peer reported its coding speed."""
        return np.all(np.isfinite(self.codec_ns), axis=1)

    def measured(self) -> np.ndarray:
        """(N, N) bool: both figures of the link come from measurements."""
        return self.delay_measured & self.bandwidth_measured

    def estimated_links(self) -> int:
        """Links (a < b) with a figure, either of which is estimated."""
        known = np.isfinite(self.delay_ms) & ~np.isnan(self.bandwidth_gbps)
        return int(np.sum(np.triu(known & ~self.measured(), 1)))

    def unmeasured(self, links: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Of the links (a, b) given (peer ids of this view), those not measured at both figures."""
        index = {p: i for i, p in enumerate(self.peers)}
        done = self.measured()
        return [(a, b) for a, b in links if a != b and not done[index[a], index[b]]]

    def link_bytes_per_s(self, src: bytes, dst: bytes) -> float | None:
        """Bytes per second of the link from `src` to `dst` (measured or estimated); None where
        either is not in the view or the link has no figure."""
        try:
            i, j = self.peers.index(src), self.peers.index(dst)
        except ValueError:
            return None
        gbps = float(self.bandwidth_gbps[i, j])
        return gbps * 1e9 / 8 if i != j and math.isfinite(gbps) and gbps > 0 else None

    def pairs_measured(self) -> int:
        """Ordered pairs of distinct peers whose delay and bandwidth both come from measurements."""
        return int(np.sum(self.measured()))

    def pairs_known(self) -> int:
        off = ~np.eye(len(self.peers), dtype=bool)
        return int(np.sum(off & np.isfinite(self.delay_ms) & np.isfinite(self.bandwidth_gbps)))

    def disputed_links(self) -> list[tuple[bytes, bytes]]:
        """Links (a, b), a < b in peer-id order, whose two ends disagree beyond the tolerance."""
        rows, cols = np.nonzero(np.triu(self.disputed, 1))
        return [(self.peers[i], self.peers[j]) for i, j in zip(rows, cols)]

    def unscaled(self, time_scale: float = 1.0, bandwidth_scale: float = 1.0) -> "NetworkView":
        """Divide an emulator's scales out: measured figures back in scenario units (the
        emulator multiplies delays by time_scale and bandwidth by bandwidth_scale / time_scale)."""
        return NetworkView(self.peers, self.delay_ms / time_scale,
                           self.bandwidth_gbps * time_scale / bandwidth_scale, self.compute_ms,
                           self.complete, self.disputed, self.one_sided, self.codec_ns,
                           self.delay_measured, self.bandwidth_measured, self.age_s, self.hosts,
                           self.compute_share)

    def as_dict(self) -> dict:
        def clean(a: np.ndarray) -> list[list[float | None]]:
            return [[None if not np.isfinite(x) else float(x) for x in row] for row in a]
        return {"peers": [p.hex() for p in self.peers], "delay_ms": clean(self.delay_ms),
                "bandwidth_gbps": clean(self.bandwidth_gbps), "complete": self.complete,
                "disputed": [[a.hex(), b.hex()] for a, b in self.disputed_links()],
                "one_sided_links": int(np.sum(np.triu(self.one_sided, 1)))}


def combine(m: np.ndarray, *, worse_is_higher: bool, tolerance: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric figures from one-sided measurements m[i, j] (nan: not measured): the worse of
    the two ends' figures, whether they disagree beyond `tolerance`, whether only one end has one."""
    a, b = m, m.T
    known_a, known_b = np.isfinite(a), np.isfinite(b)
    out = np.fmax(a, b) if worse_is_higher else np.fmin(a, b)  # fmax/fmin skip a nan
    with np.errstate(all="ignore"):  # nan where unknown, inf past a denormal: both fine here
        ratio = np.fmax(a, b) / np.fmin(a, b)
    disputed = known_a & known_b & (ratio > tolerance)
    return out, disputed, known_a ^ known_b


@dataclass
class _Claims:
    """What the reports say, as matrices: direct figures (nan: not measured) and each
    measurer's own claims."""

    rtt: np.ndarray  # (N, N) measurer i's round trip to j
    bw: np.ndarray
    age: np.ndarray  # (N, N) age of i's figures of the link to j, s
    compute: np.ndarray  # (N,)
    share: np.ndarray  # (N,) the compute's share of a core, nan unknown
    hosts: list  # (N,) bytes, b"" unknown
    codec: np.ndarray  # (N, CODEC_NS_LEN)
    coords: list  # (N,) Coordinate or None
    up: np.ndarray  # (N,) Gbps, nan unknown
    down: np.ndarray


def _matrices(index: dict[bytes, int], reports: Mapping[bytes, Report] | Iterable[Report],
              now_wall: float | None) -> _Claims:
    n = len(index)
    c = _Claims(np.full((n, n), np.nan), np.full((n, n), np.nan), np.full((n, n), np.nan), np.full(n, np.nan),
                np.full(n, np.nan), [b""] * n, np.full((n, CODEC_NS_LEN), np.nan), [None] * n, np.full(n, np.nan), np.full(n, np.nan))
    items = reports.items() if isinstance(reports, Mapping) else ((r.measurer, r) for r in reports)
    for key, r in items:
        i = index.get(r.measurer)
        if i is None or key != r.measurer:  # a report filed under another name speaks for nobody
            continue
        if np.isfinite(r.compute_ms) and r.compute_ms > 0:
            c.compute[i] = r.compute_ms
            if 0 < r.compute_share <= 1:
                c.share[i] = r.compute_share
        c.hosts[i] = r.host
        if len(r.codec_ns) == CODEC_NS_LEN and all(np.isfinite(v) and v >= 0 for v in r.codec_ns):
            c.codec[i] = r.codec_ns
        c.coords[i] = Coordinate.from_wire(r.coord)
        if np.isfinite(r.up_gbps) and r.up_gbps > 0:
            c.up[i] = r.up_gbps
        if np.isfinite(r.down_gbps) and r.down_gbps > 0:
            c.down[i] = r.down_gbps
        since = 0.0 if now_wall is None else max(0.0, now_wall - r.timestamp)
        for e in r.entries:
            j = index.get(e.target)
            if j is None or j == i:
                continue
            if np.isfinite(e.rtt_ms) and e.rtt_ms > 0:
                c.rtt[i, j] = e.rtt_ms
                c.age[i, j] = since + e.age_s
            if np.isfinite(e.bandwidth_gbps) and e.bandwidth_gbps > 0:  # 0: not measured yet
                c.bw[i, j] = e.bandwidth_gbps
    return c


def _coordinate_rtt(coords: list) -> np.ndarray:
    """(N, N) round trips predicted by the coordinates; nan where an end has none."""
    n = len(coords)
    have = [i for i, co in enumerate(coords) if co is not None]
    out = np.full((n, n), np.nan)
    if not have:
        return out
    vec = np.array([coords[i].vec for i in have])
    height = np.array([coords[i].height for i in have])
    dist = np.sqrt(((vec[:, None, :] - vec[None, :, :]) ** 2).sum(axis=2)) + height[:, None] + height[None, :]
    out[np.ix_(have, have)] = dist
    return out


def build_view(peers: Iterable[bytes], reports: Mapping[bytes, Report] | Iterable[Report], *,
               tolerance: float = DISAGREEMENT_RATIO, estimate: bool = True,
               now_wall: float | None = None) -> NetworkView:
    """The view over `peers` (rows in that order) from each measurer's report (a mapping from
    measurer to its report, or an iterable of reports). estimate: fill the links nobody
    measured from the ends' coordinates and capacities. now_wall: the wall clock the ages are
    counted to (None: ages as of each report's signing)."""
    if not tolerance >= 1.0:
        raise ValueError(f"tolerance is a ratio >= 1, got {tolerance}")
    peers = tuple(peers)
    n = len(peers)
    c = _matrices({p: i for i, p in enumerate(peers)}, reports, now_wall)
    rtt, rtt_disputed, rtt_one = combine(c.rtt, worse_is_higher=True, tolerance=tolerance)
    band, bw_disputed, bw_one = combine(c.bw, worse_is_higher=False, tolerance=tolerance)
    off = ~np.eye(n, dtype=bool)
    delay_measured = off & np.isfinite(rtt)
    bandwidth_measured = off & np.isfinite(band)
    with np.errstate(all="ignore"):
        age = np.fmax(c.age, c.age.T)
    if estimate:
        predicted = _coordinate_rtt(c.coords)
        rtt = np.where(delay_measured, rtt, predicted)
        cap = np.fmin(c.up, c.down)  # nan when either is unknown
        cap = np.where(np.isfinite(c.up) & np.isfinite(c.down), cap, np.nan)
        with np.errstate(all="ignore"):
            pair = np.minimum(cap[:, None], cap[None, :])  # nan propagates: both ends must be known
        band = np.where(bandwidth_measured, band, pair)
    delay = rtt / 2.0
    np.fill_diagonal(delay, 0.0)
    np.fill_diagonal(band, np.inf)
    complete = bool(np.all(np.isfinite(delay)) and np.all(~np.isnan(band)))
    return NetworkView(peers, delay, band, c.compute, complete, rtt_disputed | bw_disputed,
                       rtt_one | bw_one, c.codec, delay_measured, bandwidth_measured,
                       np.where(delay_measured | bandwidth_measured, age, np.nan), tuple(c.hosts), c.share)
