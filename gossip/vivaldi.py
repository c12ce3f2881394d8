"""Network coordinates: Vivaldi with a height vector, as Serf's `coordinate` package has it.

Each peer holds a `Coordinate` (a point in a few Euclidean dimensions plus a height, in
milliseconds of round trip, and an error estimate) and moves it after each round trip it
times to a peer whose coordinate it knows, so that the distance between two coordinates
predicts their round trip. Round trips to all N peers are then estimated from N coordinates,
without N pings (Dabek et al., "Vivaldi", SIGCOMM 2004; Ledlie et al., "Network
coordinates in the wild", NSDI 2007, for the height, the error weighting, the per-peer
latency filter and the gravity towards the origin).

A peer's coordinate is its own claim: a member that lies about it (a coordinate far from where
its round trips put it, a small error to be trusted) would drag every honest peer that samples
it (2 liars among 32 peers of the worldwide scenario took the honest peers' median delay error
from 6 % to 75 % in simulation). So a sample whose residual, |predicted - measured| round trip,
is far outside this peer's recent residuals (`outlier_factor` times their median, at least
`outlier_floor_ms`) moves nothing: its residual still counts toward that median, so a change of
the network that most samples see is followed, while a minority of liars, confident or not, is
set aside (tests/gossip/test_gossip_scale.py, the worldwide scenario's 32 peers: with 4 or 8
liars the honest estimates' median error is 7.1 % and 10.8 %, against 298 % and 217 % without
the rule; with no liar 7.0 % against 6.3 %). The round trips themselves are measured, not
claimed.

Sans-IO and deterministic: `Vivaldi.observe(peer, coordinate, rtt_ms)` takes one sample;
the only randomness (a direction when two coordinates coincide) comes from the `rng` given.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Coordinate", "Vivaldi", "VivaldiConfig", "COORD_DIMS", "COORD_LEN"]

COORD_DIMS = 4  # Euclidean dimensions (Serf uses 8; 4 already fit the scenarios' regions)
COORD_LEN = COORD_DIMS + 2  # on the wire: the vector, the height, the error
_ZERO = 1e-6
# A coordinate this far from the origin (vector plus height) is no estimate of any round trip
# on Earth: the update diverged (as Serf does, it starts again from the origin).
MAX_COORD_MS = 1e6


@dataclass(frozen=True)
class VivaldiConfig:
    # The error a new coordinate starts with, and the most it can reach.
    error_max: float = 1.5
    # How far one sample moves the error estimate (ce) and the coordinate (cc); Serf: 0.25.
    ce: float = 0.25
    cc: float = 0.25
    # Round trips kept per peer; the median of them is the sample (a late reply moves nothing).
    latency_filter: int = 3
    # Peers whose filters are kept; the least recently sampled is forgotten past it.
    max_filters: int = 256
    # Smallest height (ms): a peer is never predicted closer than this plus the vector part.
    height_min_ms: float = 0.01
    # Gravity towards the origin (ms): keeps the coordinates of a whole swarm from drifting.
    gravity_rho_ms: float = 150.0
    # Samples set aside as outliers (a liar's coordinate): a residual above outlier_factor x the
    # median of the last outlier_window residuals, and above outlier_floor_ms, once that many
    # are outlier_min_samples.
    outlier_window: int = 32
    outlier_factor: float = 4.0
    outlier_floor_ms: float = 20.0
    outlier_min_samples: int = 8

    def __post_init__(self) -> None:
        if not (self.error_max > 0 and 0 < self.ce <= 1 and 0 < self.cc <= 1):
            raise ValueError("error_max must be positive, ce and cc in (0, 1]")
        if self.latency_filter < 1 or self.max_filters < 1:
            raise ValueError("latency_filter and max_filters must be >= 1")
        if not (self.height_min_ms > 0 and self.gravity_rho_ms > 0):
            raise ValueError("height_min_ms and gravity_rho_ms must be positive")
        if not (self.outlier_window >= self.outlier_min_samples >= 1 and self.outlier_factor > 1
                and self.outlier_floor_ms >= 0):
            raise ValueError("need outlier_window >= outlier_min_samples >= 1, outlier_factor > 1 and "
                             "outlier_floor_ms >= 0")


@dataclass(frozen=True)
class Coordinate:
    vec: tuple[float, ...]  # COORD_DIMS figures, ms
    height: float  # ms: the access link's part of every round trip
    error: float  # relative error of the predictions, about |predicted - measured| / measured

    @classmethod
    def origin(cls, config: VivaldiConfig = VivaldiConfig()) -> "Coordinate":
        return cls((0.0,) * COORD_DIMS, config.height_min_ms, config.error_max)

    def rtt_ms(self, other: "Coordinate") -> float:
        """The round trip the two coordinates predict."""
        return math.dist(self.vec, other.vec) + self.height + other.height

    def to_wire(self) -> tuple[float, ...]:
        return (*self.vec, self.height, self.error)

    @classmethod
    def from_wire(cls, values: Sequence[float]) -> "Coordinate | None":
        """From a report's figures (checked finite and in range there): None when empty."""
        if len(values) != COORD_LEN:
            return None
        return cls(tuple(float(v) for v in values[:COORD_DIMS]), float(values[COORD_DIMS]),
                   float(values[COORD_DIMS + 1]))


class Vivaldi:
    """This peer's coordinate, moved by each round trip it measures."""

    def __init__(self, rng: random.Random, config: VivaldiConfig = VivaldiConfig()) -> None:
        self.config = config
        self._rng = rng
        self.coord = Coordinate.origin(config)
        self.samples = 0  # samples taken in all
        self.outliers = 0  # samples set aside (their residual far outside the recent ones)
        self.resets = 0  # times the coordinate diverged and started again from the origin
        self._filters: OrderedDict[bytes, deque[float]] = OrderedDict()
        self._residuals: deque[float] = deque(maxlen=config.outlier_window)

    def observe(self, peer: bytes, other: Coordinate, rtt_ms: float) -> Coordinate:
        """Take one round trip to `peer`, whose coordinate is `other`; the new coordinate."""
        cfg = self.config
        if not (math.isfinite(rtt_ms) and rtt_ms > 0) or not _usable(other):
            return self.coord
        window = self._filters.pop(peer, None) or deque(maxlen=cfg.latency_filter)
        window.append(rtt_ms)
        self._filters[peer] = window
        while len(self._filters) > cfg.max_filters:
            self._filters.popitem(last=False)
        rtt = statistics.median(window)
        c = self.coord
        dist = c.rtt_ms(other)
        residual = abs(dist - rtt)
        self._residuals.append(residual)
        if (len(self._residuals) >= cfg.outlier_min_samples and residual > cfg.outlier_floor_ms
                and residual > cfg.outlier_factor * statistics.median(self._residuals)):
            self.outliers += 1
            return c
        wrongness = residual / rtt
        total = max(c.error + other.error, _ZERO)
        weight = c.error / total
        error = min(cfg.error_max, cfg.ce * weight * wrongness + c.error * (1 - cfg.ce * weight))
        c = self._apply(Coordinate(c.vec, c.height, error), cfg.cc * weight * (rtt - dist), other)
        if _sane(c):
            gravity = -((math.dist(c.vec, (0.0,) * COORD_DIMS) / cfg.gravity_rho_ms) ** 2)
            c = self._apply(c, gravity, Coordinate((0.0,) * COORD_DIMS, 0.0, 0.0))
        if not _sane(c):
            self.resets += 1
            c = Coordinate.origin(cfg)
        self.coord = c
        self.samples += 1
        return self.coord

    def _apply(self, c: Coordinate, force: float, other: Coordinate) -> Coordinate:
        """Move c by `force` ms along the direction away from `other` (towards it when negative)."""
        diff = [a - b for a, b in zip(c.vec, other.vec)]
        mag = math.hypot(*diff)
        if mag > _ZERO:
            unit = [d / mag for d in diff]
        else:  # the two coincide: a random direction
            unit = [self._rng.uniform(-1.0, 1.0) for _ in diff]
            norm = math.hypot(*unit) or 1.0
            unit = [u / norm for u in unit]
        vec = tuple(a + u * force for a, u in zip(c.vec, unit))
        height = c.height
        if mag > _ZERO:
            height = max(self.config.height_min_ms, (c.height + other.height) * force / mag + c.height)
        return Coordinate(vec, height, c.error)


def _sane(c: Coordinate) -> bool:
    """A usable coordinate within MAX_COORD_MS of the origin."""
    return _usable(c) and math.hypot(*c.vec) + c.height <= MAX_COORD_MS


def _usable(c: Coordinate) -> bool:
    return (len(c.vec) == COORD_DIMS and all(math.isfinite(v) for v in c.vec)
            and math.isfinite(c.height) and c.height >= 0 and math.isfinite(c.error) and c.error >= 0)
