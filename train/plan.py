"""Who runs what: D pipelines of S stages, each stage a contiguous range of layers."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtfm.sched import layer_ranges

from .compress.config import CompressionConfig, LinkCodecs
from .errors import PeerId
from .spec import GPTSpec

__all__ = ["Plan", "check_compression"]


@dataclass(frozen=True)
class Plan:
    """pipelines[d][s] is the peer running stage s of pipeline d; layer_ranges[s] its blocks."""

    pipelines: tuple[tuple[PeerId, ...], ...]
    layer_ranges: tuple[tuple[int, int], ...]
    epoch: int = 0  # allocation epoch; in every message tag, so a retried step never meets stale messages
    # A per-link run's choice (which links and DP groups use the run's compression); None: every
    # link and group uses the run's `CompressionConfig` as it is.
    links: LinkCodecs | None = None
    # (pipeline, stage) of every peer, derived from `pipelines` in __post_init__
    _pos: dict[PeerId, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pipelines", tuple(tuple(p) for p in self.pipelines))
        object.__setattr__(self, "layer_ranges", tuple((int(a), int(b)) for a, b in self.layer_ranges))
        if not isinstance(self.epoch, int) or self.epoch < 0:
            raise ValueError("epoch must be a non-negative integer")
        if not self.pipelines or not self.layer_ranges:
            raise ValueError("a plan needs at least one pipeline and one stage")
        s = len(self.layer_ranges)
        if any(len(p) != s for p in self.pipelines):
            raise ValueError(f"every pipeline must list one peer for each of the {s} stages")
        peers = [x for p in self.pipelines for x in p]
        if len(set(peers)) != len(peers):
            raise ValueError("a peer may hold only one stage of one pipeline")
        start = 0
        for a, b in self.layer_ranges:
            if a != start or b <= a:
                raise ValueError(f"layer ranges {self.layer_ranges} must be contiguous, non-empty, from 0")
            start = b
        if self.links is not None:
            self.links.check(s, len(self.pipelines))
        pos = {peer: (d, i) for d, p in enumerate(self.pipelines) for i, peer in enumerate(p)}
        object.__setattr__(self, "_pos", pos)

    @classmethod
    def grid(cls, n_layer: int, stages: int, dp: int, weights: list[float] | None = None,
             prefix: str = "peer", epoch: int = 0) -> "Plan":
        """Peers named f"{prefix}{d}.{s}"; layers split as the scheduler costs them
        (`dtfm.sched.layer_ranges`): evenly, or by `weights`, the stages' relative speeds, so
        that the slowest stage's layers / weight is as small as it can be."""
        ranges = layer_ranges(n_layer, stages, weights)
        return cls(tuple(tuple(f"{prefix}{d}.{s}" for s in range(stages)) for d in range(dp)), tuple(ranges), epoch)

    @property
    def stages(self) -> int:
        return len(self.layer_ranges)

    @property
    def dp(self) -> int:
        return len(self.pipelines)

    @property
    def n_layer(self) -> int:
        return self.layer_ranges[-1][1]

    @property
    def peers(self) -> list[PeerId]:
        return [x for p in self.pipelines for x in p]

    def position(self, peer: PeerId) -> tuple[int, int]:
        """(pipeline, stage) of `peer`; KeyError if it has no place in this plan."""
        return self._pos[peer]

    def link_compressed(self, stage: int, d: int) -> bool:
        """Whether the link from `stage` to `stage` + 1 of pipeline `d` uses the run's pipeline codec."""
        return self.links is None or self.links.pp[stage][d]

    def group_compressed(self, stage: int) -> bool:
        """Whether the DP group of `stage` synchronises with the run's DP method (else exactly).
        A group of one (a single pipeline) never does: it has no replica to agree with, and its
        DP codec would only quantise and delay its own updates (DiLoCo's outer step on one
        replica): such a run trains as its pipeline codec alone would."""
        return len(self.pipelines) > 1 and (self.links is None or self.links.dp[stage])

    def dp_group(self, stage: int) -> tuple[PeerId, ...]:
        return tuple(p[stage] for p in self.pipelines)

    def pipeline(self, d: int) -> tuple[PeerId, ...]:
        return self.pipelines[d]


def check_compression(spec: GPTSpec, plan: Plan, config: CompressionConfig) -> None:
    """Refuse combinations the compressed step does not support (ValueError)."""
    if config.dp_method != "exact" and spec.tied_head and plan.stages > 1:
        raise ValueError(f"{config.dp_method} compression does not support a tied head split across stages: "
                         "the two copies would be synchronised separately")
