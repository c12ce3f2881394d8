"""`CompressionConfig`: how a run compresses each axis, validated, with named presets.

Two independent choices. The pipeline axis (activations forward, their gradients backward)
is quantized blockwise to int8 or int4, optionally after a Hadamard rotation of each block.
The data-parallel axis is exact (a ring all-reduce of fp32 gradients), `cocktail` (every
step: random sparsification, top-k, low-bit values, error feedback, of each replica's model
delta) or `diloco` (H local AdamW steps, then the group averages the compressed
pseudo-gradient and a Nesterov outer step moves every replica to the same weights). Every replica of a run must hold the same
config: payload sizes, random subsets and the synchronisation steps all derive from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from types import MappingProxyType
from typing import Any

from dtfm.fromdict import from_dict

__all__ = ["AUTO", "DP_METHODS", "PP_METHODS", "COMPRESSION_PRESETS", "DEFAULT_SLOW_LINK", "MAX_SPEC_CHARS",
           "CompressionConfig", "LinkCodecs", "get_compression", "parse_compression"]

PP_METHODS = ("exact", "int8", "int4")
DP_METHODS = ("exact", "cocktail", "diloco")
_VALUE_BITS = (2, 4, 8)
MAX_RAMP_SYNCS = 1024  # synchronisations per ramp interval: more is a run of a different method
MAX_OVERLAP_STEPS = 64  # inner steps one exchange may overlap (the gap to the next sync bounds it too)
MAX_SPEC_CHARS = 512  # a "NAME[,FIELD=VALUE...]" text: every field changed fits in about 300


def _pow2(x: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class CompressionConfig:
    """Compression of both axes; the default is exact training (no compression)."""

    # Pipeline axis.
    pp_method: str = "exact"  # int8: ~3.9x fewer bytes, error ~0.4 % of a block's max; int4: ~7.5x, ~7 %
    pp_hadamard: bool = False  # rotate each block first: spreads outliers so int4 keeps small values
    pp_block_elems: int = 64  # elements per fp16 scale: smaller blocks are more accurate, cost 16 bits each
    # Data-parallel axis.
    dp_method: str = "exact"
    dp_random_fraction: float = 0.1  # cocktail: share of elements drawn at random each step (shared seed)
    dp_topk_fraction: float = 0.2  # share of each chunk's candidates sent (the largest by magnitude)
    dp_value_bits: int = 4  # bits per sent value (2, 4 or 8), one fp16 scale per chunk
    dp_chunk_elems: int = 1024  # candidates per chunk: the unit of top-k, of index coding and of a scale
    dp_warmup_steps: int = 0  # steps of exact DP all-reduce before compression starts (early gradients are large)
    inner_steps: int = 16  # diloco: local AdamW steps between synchronisations (H); more: fewer bytes, drift
    # diloco: synchronisations at each interval 1, 2, 4, ... below H before the interval is H
    # (the warm start: early pseudo-gradients are large and replicas drift apart fastest; each
    # ramped sync costs one compressed payload, not the 128x larger exact all-reduce, and
    # averages the replicas, see `ramp_sync`); 0: H from the start
    dp_ramp_syncs: int = 0
    # diloco: inner steps a synchronisation's exchange overlaps (streaming DiLoCo's delayed outer
    # update): the pseudo-gradient of the sync after step t is sent at once, the next inner steps
    # compute while it travels, and the outer step lands after step t + tau (tau: this, at most the
    # gap to the next sync), keeping each replica's local progress since t on top; 0: the stage
    # waits for the exchange (more: hides longer exchanges, the outer update acts later)
    dp_overlap_steps: int = 0
    # (cocktail synchronises after every step)
    outer_lr: float = 0.7  # outer SGD learning rate on the averaged pseudo-gradient (1, momentum 0: plain average)
    outer_momentum: float = 0.9  # outer (Nesterov) momentum; 0 leaves it to error feedback
    outer_nesterov: bool = True  # Nesterov momentum (as in DiLoCo) rather than heavy ball
    # Per link: the swarm's coordinator lets each pipeline link and each stage's DP group use
    # this config's codec or stay exact, as the scheduler finds it pays (`LinkCodecs`); not one
    # setting for the whole run. Only a swarm's allocation chooses; `LocalCluster` takes the plan's.
    per_link: bool = False

    def __post_init__(self) -> None:
        if self.pp_method not in PP_METHODS:
            raise ValueError(f"pp_method must be one of {PP_METHODS}, got {self.pp_method!r}")
        if self.dp_method not in DP_METHODS:
            raise ValueError(f"dp_method must be one of {DP_METHODS}, got {self.dp_method!r}")
        if not all(isinstance(v, bool) for v in (self.pp_hadamard, self.outer_nesterov, self.per_link)):
            raise ValueError("pp_hadamard, outer_nesterov and per_link must be booleans")
        if self.per_link and self.exact:
            raise ValueError("per_link needs a compression to choose per link (e.g. slow-link,per_link=true or auto)")
        if not _pow2(self.pp_block_elems) or not 8 <= self.pp_block_elems <= 4096:
            raise ValueError(f"pp_block_elems must be a power of two in [8, 4096], got {self.pp_block_elems!r}")
        if not _pow2(self.dp_chunk_elems) or not 64 <= self.dp_chunk_elems <= 65536:
            raise ValueError(f"dp_chunk_elems must be a power of two in [64, 65536], got {self.dp_chunk_elems!r}")
        for name in ("dp_random_fraction", "dp_topk_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
        if self.dp_value_bits not in _VALUE_BITS or isinstance(self.dp_value_bits, bool):
            raise ValueError(f"dp_value_bits must be one of {_VALUE_BITS}, got {self.dp_value_bits!r}")
        for name in ("dp_warmup_steps", "inner_steps", "dp_ramp_syncs", "dp_overlap_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.inner_steps < 1:
            raise ValueError("inner_steps must be at least 1")
        if self.dp_overlap_steps and self.dp_method != "diloco":
            raise ValueError("dp_overlap_steps needs dp_method=diloco (cocktail applies its exchange every step)")
        if self.dp_overlap_steps > MAX_OVERLAP_STEPS:
            raise ValueError(f"dp_overlap_steps must be at most {MAX_OVERLAP_STEPS}, got {self.dp_overlap_steps!r}")
        if self.dp_ramp_syncs > MAX_RAMP_SYNCS:
            raise ValueError(f"dp_ramp_syncs must be at most {MAX_RAMP_SYNCS}, got {self.dp_ramp_syncs!r}")
        lr = self.outer_lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
            raise ValueError(f"outer_lr must be positive, got {self.outer_lr!r}")
        m = self.outer_momentum
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1:
            raise ValueError(f"outer_momentum must lie in [0, 1), got {m!r}")

    @property
    def exact(self) -> bool:
        return self.pp_method == "exact" and self.dp_method == "exact"

    @property
    def dp_topk_per_chunk(self) -> int:
        """Values sent per chunk of `dp_chunk_elems` candidates (at least one)."""
        return max(1, round(self.dp_topk_fraction * self.dp_chunk_elems))

    @property
    def ramp_periods(self) -> tuple[int, ...]:
        """DiLoCo's warm start: the intervals 1, 2, 4, ... below H, each held for
        `dp_ramp_syncs` synchronisations before the interval is H (none without a ramp)."""
        if self.dp_method != "diloco" or not self.dp_ramp_syncs:
            return ()
        out, p = [], 1
        while p < self.inner_steps:
            out.append(p)
            p *= 2
        return tuple(out)

    @property
    def ramp_steps(self) -> int:
        """Local steps the warm start spans (after the exact warm-up steps)."""
        return self.dp_ramp_syncs * sum(self.ramp_periods)

    def sync_due(self, step: int) -> bool:
        """Whether a compressed synchronisation follows the update of step `step`: every step
        for cocktail; for DiLoCo after the ramp's intervals (`ramp_periods`), then every H
        steps. A function of the step alone, so every replica, a resumed run and a stage
        fetched mid-ramp agree on it."""
        if self.dp_method == "exact" or step < self.dp_warmup_steps:
            return False
        if self.dp_method == "cocktail":
            return True
        done, start = step + 1 - self.dp_warmup_steps, 0  # local steps done with this one
        for period in self.ramp_periods:
            span = self.dp_ramp_syncs * period
            if done <= start + span:
                return (done - start) % period == 0
            start += span
        return (done - start) % self.inner_steps == 0

    def ramp_sync(self, step: int) -> bool:
        """Whether a synchronisation after step `step` is one of the warm start's: it averages
        the replicas (outer lr 1, no momentum: an outer step at the preset's lr and momentum
        over a step or two of drift would multiply the inner learning rate); the outer
        optimizer, its momentum included, starts with the first synchronisation at interval H."""
        return bool(self.ramp_periods) and self.sync_due(step) and \
            step + 1 - self.dp_warmup_steps <= self.ramp_steps

    def overlap_of(self, step: int) -> int:
        """Inner steps the exchange of the synchronisation after step `step` overlaps: the outer
        update lands after step `step` + this. `dp_overlap_steps`, but never past the next
        synchronisation (whose pseudo-gradient starts from that update); 0 when no sync is due."""
        if not self.dp_overlap_steps or not self.sync_due(step):
            return 0
        for gap in range(1, self.dp_overlap_steps + 1):
            if self.sync_due(step + gap):
                return gap
        return self.dp_overlap_steps

    def apply_due(self, step: int) -> int | None:
        """The step whose synchronisation's outer update lands after the update of step `step`
        (an overlapped exchange completing), or None. A function of the step alone: every
        replica, a resumed run and a stage fetched mid-exchange agree on it."""
        for start in range(max(0, step - self.dp_overlap_steps), step):
            if self.overlap_of(start) == step - start:
                return start
        return None

    def in_flight(self, step: int) -> int | None:
        """The step whose synchronisation is still being exchanged when step `step` starts
        (sent, its outer update not yet applied), or None: a stage stopped before step `step`
        keeps that exchange's origin (`compress/origin/`) to complete it on resumption."""
        for start in range(max(0, step - self.dp_overlap_steps), step):
            if start + self.overlap_of(start) >= step:
                return start
        return None

    def syncs_in(self, steps: int) -> int:
        """Compressed synchronisations in steps 0 .. steps - 1."""
        return sum(self.sync_due(k) for k in range(steps))

    def describe(self) -> str:
        pp = "exact" if self.pp_method == "exact" else \
            f"{self.pp_method}{'+hadamard' if self.pp_hadamard else ''}/{self.pp_block_elems}"
        if self.dp_method == "exact":
            dp = "exact"
        else:
            rnd = f"random {self.dp_random_fraction:g} x " if self.dp_method == "cocktail" else ""
            dp = f"{self.dp_method} {rnd}top {self.dp_topk_fraction:g} x {self.dp_value_bits} bit"
            if self.dp_method == "diloco":
                dp += f", H={self.inner_steps}, outer lr {self.outer_lr:g} momentum {self.outer_momentum:g}"
                if self.ramp_periods:
                    ramp = ", ".join(str(p) for p in self.ramp_periods)
                    dp += f", warm start: {self.dp_ramp_syncs} syncs each every {ramp} steps ({self.ramp_steps} steps)"
            if self.dp_overlap_steps:
                dp += f", exchange overlapping {self.dp_overlap_steps} inner step{'s' if self.dp_overlap_steps > 1 else ''}"
            if self.dp_warmup_steps:
                dp += f", {self.dp_warmup_steps} exact warm-up steps"
        return f"pipeline {pp}; data-parallel {dp}" + ("; per link (exact where it does not pay)" if self.per_link else "")

    @property
    def pp_name(self) -> str:
        """The pipeline codec's short name (int4+hadamard/64), as dtfm.sched names it."""
        if self.pp_method == "exact":
            return "exact"
        return f"{self.pp_method}{'+hadamard' if self.pp_hadamard else ''}/{self.pp_block_elems}"

    @property
    def dp_name(self) -> str:
        """The data-parallel method with its period (diloco H=16, cocktail), for logs."""
        if self.dp_method == "diloco":
            return f"diloco H={self.inner_steps}"
        return self.dp_method

    def with_options(self, items: list[str]) -> "CompressionConfig":
        """This config with "field=value" overrides (as the command line gives them); ValueError if bad."""
        kinds: dict[str, type] = {"str": str, "bool": bool, "int": int, "float": float}
        types = {f.name: kinds[str(f.type)] for f in fields(self)}
        changes: dict[str, object] = {}
        for item in items:
            key, sep, text = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in types:
                raise ValueError(f"compression option {item!r} is not FIELD=VALUE with FIELD one of {sorted(types)}")
            kind = types[key]
            try:
                if kind is bool:
                    if text.lower() not in ("true", "false", "1", "0"):
                        raise ValueError(text)
                    changes[key] = text.lower() in ("true", "1")
                else:
                    changes[key] = kind(text)
            except ValueError:
                raise ValueError(f"compression option {key}: {text!r} is not a {kind.__name__}") from None
        return replace(self, **changes)  # type: ignore[arg-type]  # checked by __post_init__

    def to_dict(self) -> dict:
        return asdict(self)

    def to_spec(self) -> str:
        """The config as `parse_compression` reads it: the first preset (in sorted name order)
        that differs from it in the fewest fields, then those fields in field order, so one
        config has one text (what an operator's signed start carries)."""
        def changed(base: CompressionConfig) -> list[str]:
            return [f.name for f in fields(self) if getattr(self, f.name) != getattr(base, f.name)]
        name = min(sorted(COMPRESSION_PRESETS), key=lambda n: len(changed(COMPRESSION_PRESETS[n])))
        return ",".join([name] + [f"{k}={getattr(self, k)!r}".replace("'", "")
                                  for k in changed(COMPRESSION_PRESETS[name])])

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CompressionConfig":
        return from_dict(cls, d, "compression config")


_PP4 = CompressionConfig(pp_method="int4", pp_hadamard=True, pp_block_elems=64)
# Every element at 2 bits (no index) costs the bytes of the top 25 % at 4 bits plus their
# indices, and trains better: +4.5 % against +10.9 % after 600 steps of `tiny` (momentum 0.8
# against 0.9 is part of it; docs/compression.md, "What was tried").
# The warm start: 8 synchronisations at each interval 1, 2, 4 and 8 steps (the first 120 local
# steps, 32 synchronisations) before every 16 (docs/compression.md, "Warm-up").
_DILOCO = CompressionConfig(dp_method="diloco", dp_topk_fraction=1.0, dp_value_bits=2, dp_chunk_elems=1024,
                            inner_steps=16, outer_lr=0.7, outer_momentum=0.8, dp_ramp_syncs=8)
# What a run over slow links should use (see docs/compression.md): both axes compressed.
DEFAULT_SLOW_LINK = "slow-link"

COMPRESSION_PRESETS = MappingProxyType({
    # No compression: the single-process oracle holds to 1e-5.
    "exact": CompressionConfig(),
    # Pipeline only: ~3.9x fewer activation bytes, loss indistinguishable from exact.
    "pp-int8": CompressionConfig(pp_method="int8", pp_hadamard=False, pp_block_elems=64),
    # Pipeline only: ~7.5x fewer activation bytes; the rotation keeps outlier blocks usable.
    "pp-int4": _PP4,
    # DP only, every step: random 10 %, top 20 % of those, 4-bit values, error feedback, of each
    # replica's model delta; the group's mean is applied as it is (outer lr 1, no momentum).
    "cocktail": CompressionConfig(dp_method="cocktail", dp_random_fraction=0.1, dp_topk_fraction=0.2,
                                  dp_value_bits=4, dp_chunk_elems=1024, outer_lr=1.0, outer_momentum=0.0),
    # DP only, every 16 steps after a warm start (intervals 1, 2, 4, 8): every element of the
    # pseudo-gradient at 2 bits, error feedback, Nesterov outer step.
    "diloco": _DILOCO,
    DEFAULT_SLOW_LINK: replace(_DILOCO, pp_method=_PP4.pp_method, pp_hadamard=_PP4.pp_hadamard,
                               pp_block_elems=_PP4.pp_block_elems),
})


# `--compress auto`: the slow-link codecs, each link and DP group compressed only where the
# coordinator's scheduler predicts it pays.
AUTO = "auto"


@dataclass(frozen=True)
class LinkCodecs:
    """Which links of a per-link run compress (with the run's codec of that axis) and which stay exact.

    pp[s][d]: the link from stage s to stage s + 1 of pipeline d (activations forward, their
    gradients backward: sender and receiver read the same entry); dp[s]: the DP group of stage s
    synchronises with the run's DP method (else: the exact all-reduce, every step)."""

    pp: tuple[tuple[bool, ...], ...]
    dp: tuple[bool, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "pp", tuple(tuple(row) for row in self.pp))
        object.__setattr__(self, "dp", tuple(self.dp))
        for v in [x for row in self.pp for x in row] + list(self.dp):
            if type(v) is not bool:
                raise ValueError(f"a link's choice is a boolean, got {v!r:.40}")

    @classmethod
    def uniform(cls, stages: int, dp: int, pp: bool = True, groups: bool = True) -> "LinkCodecs":
        return cls(tuple((pp,) * dp for _ in range(stages - 1)), (groups,) * stages)

    def check(self, stages: int, dp: int) -> None:
        """ValueError unless this covers `stages` x `dp`: stages - 1 rows of dp links, stages groups."""
        if len(self.dp) != stages or len(self.pp) != stages - 1 or any(len(r) != dp for r in self.pp):
            raise ValueError(f"per-link codecs for {stages} stages x {dp} pipelines need {stages - 1} x {dp} "
                             f"links and {stages} groups")

    def describe(self, config: CompressionConfig) -> str:
        """"links compressed: p0 s0->s1 int4+hadamard/64, ...; DP groups compressed: s1 diloco H=16"."""
        links = [f"p{d} s{s}->s{s + 1}" for s, row in enumerate(self.pp) for d, on in enumerate(row) if on]
        groups = [f"s{s}" for s, on in enumerate(self.dp) if on]
        pp = f"{len(links)}/{sum(map(len, self.pp))} links {config.pp_name}" + (f" ({', '.join(links)})" if links else "")
        dp = f"{len(groups)}/{len(self.dp)} DP groups {config.dp_name}" + (f" ({', '.join(groups)})" if groups else "")
        return f"{pp}; {dp}"


def get_compression(name: str) -> CompressionConfig:
    try:
        return COMPRESSION_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown compression preset {name!r}; choose one of {sorted(COMPRESSION_PRESETS)}") from None


def parse_compression(text: str) -> CompressionConfig:
    """The config "NAME[,FIELD=VALUE...]" names: preset NAME with those fields changed (as
    `--compress` takes it); ValueError naming what is wrong."""
    if not isinstance(text, str) or len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"a compression is a preset name and FIELD=VALUE options, at most {MAX_SPEC_CHARS} "
                         "characters")
    name, *options = [part.strip() for part in text.split(",")]
    base = replace(get_compression(DEFAULT_SLOW_LINK), per_link=True) if name == AUTO else get_compression(name)
    return base.with_options([o for o in options if o])
