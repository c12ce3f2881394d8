"""Compression in the scheduler's terms: what each method puts on the wire, what coding costs.

The scheduler knows no torch, so it mirrors the payload formulas of `dtfm.train.compress`
(`dense_payload_bytes`, `sparse_payload_bytes`, the cocktail candidate count) in plain
integer arithmetic; tests/sched/test_sched_compress.py checks them against the codec's own, and
`WIRE_PRESETS` against `COMPRESSION_PRESETS`, so the two cannot drift apart.

- `PipelineCodec`: one pipeline link's activations and activation gradients. int8/int4 payload
  of n elements in blocks of B: 12 + 2 ceil(n/B) + ceil(n/B) B bits/8 bytes (header, an fp16
  ratio per block, the codes of the zero-padded blocks).
- `DataParallelCodec`: one DP group's synchronisation. Exact is the paper's ring (2 shards of
  1/D per pair); cocktail and diloco send one sparse payload to every other member
  (all-gather), cocktail every step over ceil(fraction n) random candidates, diloco every H
  steps over all n: 12 + 2 c + ceil(c k bits/8) + index bytes for c chunks of k values.
- `CodecSpeed`: nanoseconds per element of coding on a peer's CPU, measured by
  `dtfm.train.compress.measure_compress_cost()`; the scheduler takes the figure as input.
  `to_vector()`/`from_vector()` give it as the plain list of floats gossip carries.
- `CompressionOptions`: the codecs the scheduler may choose from, per axis, least lossy first
  (exact always first), and the codec speed: one for every peer, or each peer's own
  (`peer_speeds`, in the cost model's peer order).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from types import MappingProxyType
from typing import Any, Iterable, Protocol, TypeVar

from dtfm.fromdict import from_dict

__all__ = ["CODEC_SPEED_LEN", "CodecAssignment", "CodecSpeed", "CompressionFields", "CompressionOptions", "DataParallelCodec",
           "PipelineCodec", "REFERENCE_CODEC_SPEED", "STEP_EFFICIENCY", "WIRE_PRESETS", "compression_options",
           "load_codec_speed", "step_efficiency", "wire_codecs"]

_HEADER_BYTES = 12
_DENSE_BITS = {"int8": 8, "int4": 4}
PP_CODEC_METHODS = ("exact", "int8", "int4")
DP_CODEC_METHODS = ("exact", "cocktail", "diloco")


def _pow2(x: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class PipelineCodec:
    """How one pipeline link codes its activations (forward) and their gradients (backward)."""

    method: str = "exact"  # exact, int8 or int4
    hadamard: bool = False  # rotate each block first (int4's outlier fix); costs coding time, no bytes
    block_elems: int = 64  # elements per fp16 scale

    def __post_init__(self) -> None:
        if self.method not in PP_CODEC_METHODS:
            raise ValueError(f"pipeline codec method must be one of {PP_CODEC_METHODS}, got {self.method!r}")
        if not _pow2(self.block_elems) or not 8 <= self.block_elems <= 4096:
            raise ValueError(f"block_elems must be a power of two in [8, 4096], got {self.block_elems!r}")
        if self.method == "exact" and (self.hadamard or self.block_elems != 64):
            object.__setattr__(self, "hadamard", False)  # no blocks without quantization: one exact codec
            object.__setattr__(self, "block_elems", 64)

    @property
    def exact(self) -> bool:
        return self.method == "exact"

    @property
    def name(self) -> str:
        if self.exact:
            return "exact"
        return f"{self.method}{'+hadamard' if self.hadamard else ''}/{self.block_elems}"

    def payload_bytes(self, numel: int, elem_bytes: int) -> int:
        """Bytes of one message of `numel` elements (`elem_bytes` each when sent exact)."""
        if self.exact:
            return numel * elem_bytes
        nb = -(-numel // self.block_elems)
        return _HEADER_BYTES + 2 * nb + nb * self.block_elems * _DENSE_BITS[self.method] // 8

    def coding_ns_per_elem(self, speed: "CodecSpeed") -> tuple[float, float]:
        """(encode at the sender, decode at the receiver), nanoseconds per element."""
        if self.exact:
            return 0.0, 0.0
        rot = speed.hadamard_ns_per_elem if self.hadamard else 0.0
        if self.method == "int8":
            return speed.int8_encode_ns_per_elem + rot, speed.int8_decode_ns_per_elem + rot
        return speed.int4_encode_ns_per_elem + rot, speed.int4_decode_ns_per_elem + rot


@dataclass(frozen=True)
class DataParallelCodec:
    """How one stage's DP group synchronises. Fields a method does not use are normalised away,
    so two codecs that put the same bytes on the wire compare equal."""

    method: str = "exact"  # exact (the paper's ring), cocktail (every step), diloco (every H steps)
    random_fraction: float = 1.0  # cocktail: share of the elements that are candidates
    topk_fraction: float = 1.0  # share of each chunk's candidates sent
    value_bits: int = 8  # bits per sent value
    chunk_elems: int = 1024  # candidates per chunk
    inner_steps: int = 1  # diloco: steps between synchronisations (H)
    # diloco: inner steps each synchronisation's exchange overlaps (`dp_overlap_steps`): the
    # exchange is on the critical path only for what the next steps' compute does not hide
    overlap_steps: int = 0

    def __post_init__(self) -> None:
        if self.method not in DP_CODEC_METHODS:
            raise ValueError(f"data-parallel codec method must be one of {DP_CODEC_METHODS}, got {self.method!r}")
        for name in ("random_fraction", "topk_fraction"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"{name} must lie in (0, 1], got {v!r}")
        if self.value_bits not in (2, 4, 8) or isinstance(self.value_bits, bool):
            raise ValueError(f"value_bits must be 2, 4 or 8, got {self.value_bits!r}")
        if not _pow2(self.chunk_elems) or not 64 <= self.chunk_elems <= 65536:
            raise ValueError(f"chunk_elems must be a power of two in [64, 65536], got {self.chunk_elems!r}")
        if not isinstance(self.inner_steps, int) or isinstance(self.inner_steps, bool) or self.inner_steps < 1:
            raise ValueError(f"inner_steps must be a positive integer, got {self.inner_steps!r}")
        if not isinstance(self.overlap_steps, int) or isinstance(self.overlap_steps, bool) or self.overlap_steps < 0:
            raise ValueError(f"overlap_steps must be a non-negative integer, got {self.overlap_steps!r}")
        if self.method == "exact":
            canon = DataParallelCodec.__dataclass_fields__
            for f in fields(self):
                if f.name != "method":
                    object.__setattr__(self, f.name, canon[f.name].default)
        elif self.method == "cocktail":
            object.__setattr__(self, "inner_steps", 1)
            object.__setattr__(self, "overlap_steps", 0)
        else:
            object.__setattr__(self, "random_fraction", 1.0)

    @property
    def exact(self) -> bool:
        return self.method == "exact"

    @property
    def period_steps(self) -> int:
        """Steps per synchronisation: H for diloco, 1 otherwise."""
        return self.inner_steps if self.method == "diloco" else 1

    @property
    def topk_per_chunk(self) -> int:
        return max(1, round(self.topk_fraction * self.chunk_elems))

    @property
    def name(self) -> str:
        if self.exact:
            return "exact"
        rnd = f"random {self.random_fraction:g} x " if self.method == "cocktail" else ""
        every = f", H={self.inner_steps}" if self.method == "diloco" else ""
        if self.overlap_steps:
            every += f", overlapping {self.overlap_steps}"
        return f"{self.method} {rnd}top {self.topk_fraction:g} x {self.value_bits} bit{every}"

    def candidates(self, numel: int) -> int:
        """Elements compressed per synchronisation (as `StageCompression` draws them)."""
        if self.method == "cocktail":
            return min(numel, max(1, math.ceil(self.random_fraction * numel)))
        return numel

    def payload_bytes(self, numel: int) -> int:
        """Bytes of one member's payload for a stage of `numel` parameters (not for exact)."""
        if self.exact:
            raise ValueError("the exact all-reduce sends shards, not one payload")
        m, chunk, k, bits = self.candidates(numel), self.chunk_elems, self.topk_per_chunk, self.value_bits
        nch = -(-m // chunk)
        fmt = 2 if k == chunk else 0 if chunk <= 16 * k else 1
        index = (nch * chunk // 8, 2 * nch * k, 0)[fmt]
        return _HEADER_BYTES + 2 * nch + -(-nch * k * bits // 8) + index

    def coding_ns_per_elem(self, speed: "CodecSpeed", members: int) -> float:
        """Nanoseconds per candidate element one member spends coding a synchronisation: its own
        payload encoded, every member's (its own included) decoded."""
        if self.exact:
            return 0.0
        return speed.sparse_encode_ns_per_elem + members * speed.sparse_decode_ns_per_elem


@dataclass(frozen=True)
class CodecSpeed:
    """What coding costs on a peer's CPU, in nanoseconds per element of the uncompressed tensor
    (float32 in, float32 out). All zero: coding is free (an upper bound of what compression saves)."""

    int8_encode_ns_per_elem: float = 0.0
    int8_decode_ns_per_elem: float = 0.0
    int4_encode_ns_per_elem: float = 0.0
    int4_decode_ns_per_elem: float = 0.0
    hadamard_ns_per_elem: float = 0.0  # the block rotation, added on each side
    sparse_encode_ns_per_elem: float = 0.0  # per candidate: top-k, quantize, pack, error feedback
    sparse_decode_ns_per_elem: float = 0.0  # per candidate of one payload decoded and summed

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < math.inf):
                raise ValueError(f"{f.name} must be a finite non-negative number, got {v!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CodecSpeed":
        return from_dict(cls, d, "codec speed", float)

    def to_vector(self) -> tuple[float, ...]:
        """The figures in field order (`CODEC_SPEED_LEN` floats): what a gossip report carries."""
        return tuple(float(getattr(self, f.name)) for f in fields(self))

    @classmethod
    def from_vector(cls, v: Iterable[float]) -> "CodecSpeed":
        """The inverse of `to_vector`; ValueError for a vector of the wrong length or values."""
        v = tuple(v)
        names = [f.name for f in fields(cls)]
        if len(v) != len(names):
            raise ValueError(f"a codec speed vector has {len(names)} figures ({', '.join(names)}), got {len(v)}")
        return cls(**dict(zip(names, (float(x) for x in v))))


CODEC_SPEED_LEN = len(fields(CodecSpeed))  # floats in `CodecSpeed.to_vector()`


# Measured with `measure_compress_cost()` (one torch thread, 4 Mi elements, best of 3) on the
# 2-core development machine, 2026-11-25, rounded. A GPU codes far faster; a peer should
# measure its own (`bench/compress_sched.py --codec-speed-out FILE`).
REFERENCE_CODEC_SPEED = CodecSpeed(
    int8_encode_ns_per_elem=2.9, int8_decode_ns_per_elem=1.0,
    int4_encode_ns_per_elem=6.6, int4_decode_ns_per_elem=2.3, hadamard_ns_per_elem=6.6,
    sparse_encode_ns_per_elem=20.7, sparse_decode_ns_per_elem=5.6)


def load_codec_speed(name: str) -> CodecSpeed:
    """A codec speed by name: `reference` (`REFERENCE_CODEC_SPEED`), `free` (coding costs
    nothing) or the path of a JSON object of `CodecSpeed` fields (as
    `bench/compress_sched.py --codec-speed-out` writes). OSError when the file cannot be read,
    ValueError when it is not a codec speed."""
    if name == "reference":
        return REFERENCE_CODEC_SPEED
    if name == "free":
        return CodecSpeed()
    with open(name, encoding="utf-8") as f:
        d = json.load(f)  # (a JSONDecodeError is a ValueError)
    if not isinstance(d, dict):
        raise ValueError("expected a JSON object")
    try:
        return CodecSpeed.from_dict(d)
    except TypeError as e:  # a value that is no number
        raise ValueError(str(e)) from None


class CompressionFields(Protocol):
    """The fields of `dtfm.train.compress.CompressionConfig` the wire cost depends on (read-only,
    as a frozen dataclass has them)."""

    @property
    def pp_method(self) -> str: ...
    @property
    def pp_hadamard(self) -> bool: ...
    @property
    def pp_block_elems(self) -> int: ...
    @property
    def dp_method(self) -> str: ...
    @property
    def dp_random_fraction(self) -> float: ...
    @property
    def dp_topk_fraction(self) -> float: ...
    @property
    def dp_value_bits(self) -> int: ...
    @property
    def dp_chunk_elems(self) -> int: ...
    @property
    def inner_steps(self) -> int: ...
    @property
    def dp_overlap_steps(self) -> int: ...


def wire_codecs(config: CompressionFields) -> tuple[PipelineCodec, DataParallelCodec]:
    """The two codecs of a run's compression config (a `CompressionConfig`, read by field name)."""
    pp = PipelineCodec(config.pp_method, config.pp_hadamard, config.pp_block_elems)
    dp = DataParallelCodec(config.dp_method, config.dp_random_fraction, config.dp_topk_fraction,
                           config.dp_value_bits, config.dp_chunk_elems, config.inner_steps,
                           config.dp_overlap_steps if config.dp_method == "diloco" else 0)
    return pp, dp


_INT4 = PipelineCodec("int4", True, 64)
_DILOCO = DataParallelCodec("diloco", topk_fraction=1.0, value_bits=2, chunk_elems=1024, inner_steps=16)
# The wire side of train's COMPRESSION_PRESETS, name for name (tested equal).
WIRE_PRESETS = MappingProxyType({
    "exact": (PipelineCodec(), DataParallelCodec()),
    "pp-int8": (PipelineCodec("int8", False, 64), DataParallelCodec()),
    "pp-int4": (_INT4, DataParallelCodec()),
    "cocktail": (PipelineCodec(), DataParallelCodec("cocktail", 0.1, 0.2, 4, 1024)),
    "diloco": (PipelineCodec(), _DILOCO),
    "slow-link": (_INT4, _DILOCO),
})

# Least lossy first, from the measured loss gaps (docs/compression.md): int8 -0.05 %, int4
# +0.26 %, diloco +4.5 %, cocktail +42.7 %. On a tie in predicted time the earlier one wins.
_PP_RANK = {"exact": 0, "int8": 1, "int4": 2}
_DP_RANK = {"exact": 0, "diloco": 1, "cocktail": 2}


# Step efficiency: how many exact steps one step with the codec is worth (the steps exact needs
# to reach the loss the codec reaches, over the codec's steps), measured on `tiny`. Time to a
# target loss is iteration time / step efficiency. Sources:
# - int8, int4 (+ Hadamard): no measurable loss cost: int8 -0.05 %, int4 +0.26 % training loss
#   after 600 steps, -0.02 % held-out (docs/compression.md, "Benchmark", and a held-out
#   evaluation of 2026-11-28), below exact's own seed-to-seed noise; on the daemons, int4
#   alone (one pipeline) 0.89-1.07 over seeds 0-2 at step 64 (bench/compress_swarm.py
#   --stages 4, 2026-11-30), the reading's resolution: 1.0;
# - diloco (dense 2 bit, H = 16, outer Nesterov 0.7/0.8): the synchronised model after about
#   584 steps matches exact at about 480 (0.82; slow-link, int4 pipeline included, 464: 0.79),
#   held-out loss (the evaluation of 2026-11-28); on training loss 0.72 (exact's 50-step
#   mean reaches diloco's 2.1536 at step 433 of 600); on the daemons, slow-link and auto,
#   0.75-0.83 over seeds 0-2, mean 0.78 (77-85 steps to exact's 16-step mean loss at step 64,
#   bench/compress_swarm.py, 2026-11-29): 0.8;
# - cocktail (random 10 % x top 20 % x 4 bit of model deltas): exact's 50-step trailing mean reaches
#   cocktail's 600-step figure (2.9415) at step 61 (`python -m dtfm.train --stages 2 --dp 4
#   --steps 300 --log-json`, 2026-11-29): 0.1.
# docs/compression.md, "How the scheduler chooses", keeps the table and its sources.
STEP_EFFICIENCY = MappingProxyType({"exact": 1.0, "int8": 1.0, "int4": 1.0, "diloco": 0.8, "cocktail": 0.1})


def step_efficiency(codecs: "CodecAssignment", table: Mapping[str, float] = STEP_EFFICIENCY) -> float:
    """The step efficiency of a plan (`STEP_EFFICIENCY` by codec method): the product over the
    two axes of the least efficient codec each uses. Only uniform runs are measured, so an axis
    with any link or group compressed is charged as if all were: a DiLoCo group desynchronises
    its stage's replicas whatever the others do, and the loss is the whole model's. (One
    pipeline's groups of one member synchronise nothing: every assignment gives them no DP codec,
    `CodecAssignment.uniform` and the per-link choice alike, as the trainer runs them.) KeyError
    for a method the table lacks."""
    pp = min((table[c.method] for row in codecs.pp for c in row), default=1.0)
    dp = min((table[c.method] for c in codecs.dp), default=1.0)
    return min(pp, 1.0) * min(dp, 1.0)


def shape_step_efficiency(options: "CompressionOptions | None", stages: int, dp: int,
                          table: Mapping[str, float] = STEP_EFFICIENCY) -> float:
    """The step efficiency of an S x D run that may use `options`' codecs (None: exact), charged
    as `step_efficiency` charges a plan: each axis at its least efficient codec, as if every
    link or group used it. An axis with nothing to send costs nothing: one stage has no
    pipeline link, and one pipeline no DP group to synchronise (its groups of one all-reduce
    nothing, compressed or not). So a compressed run of one pipeline loses only what its
    pipeline codec loses, which is how the fastest shape to a target loss can leave out the
    peers whose DP groups would cost steps."""
    if options is None:
        return 1.0
    pp = min(options.pp, key=lambda c: table[c.method])
    groups = min(options.dp, key=lambda c: table[c.method])
    return step_efficiency(CodecAssignment.uniform(stages, dp, pp, groups), table)


@dataclass(frozen=True)
class CompressionOptions:
    """The codecs the scheduler may choose from on each axis (exact first, then least lossy
    first: on a tie the earlier wins) and what coding costs: `speed` on every peer, or, when
    `peer_speeds` is given, each peer's own (one per peer of the network the cost model is
    built on, in its order; a link's encode is costed on its sender, its decode on its
    receiver, a DP member's coding on that member)."""

    pp: tuple[PipelineCodec, ...] = (PipelineCodec(),)
    dp: tuple[DataParallelCodec, ...] = (DataParallelCodec(),)
    speed: CodecSpeed = CodecSpeed()
    peer_speeds: tuple[CodecSpeed, ...] = ()  # empty: `speed` for every peer

    def __post_init__(self) -> None:
        object.__setattr__(self, "peer_speeds", tuple(self.peer_speeds))
        if any(not isinstance(v, CodecSpeed) for v in self.peer_speeds):
            raise ValueError("peer_speeds must be CodecSpeed figures, one per peer")
        for axis, codecs in (("pp", self.pp), ("dp", self.dp)):
            if not codecs or not codecs[0].exact:
                raise ValueError(f"{axis} options must start with the exact codec")
            if len(set(codecs)) != len(codecs) or any(c.exact for c in codecs[1:]):
                raise ValueError(f"{axis} options repeat a codec: {[c.name for c in codecs]}")

    @property
    def exact(self) -> bool:
        """Nothing to choose: exact on both axes."""
        return len(self.pp) == 1 and len(self.dp) == 1

    def to_dict(self) -> dict:
        """Plain data (a view file keeps the options a first placement was searched with)."""
        return {"pp": [asdict(c) for c in self.pp], "dp": [asdict(c) for c in self.dp],
                "speed": self.speed.to_dict(), "peer_speeds": [list(s.to_vector()) for s in self.peer_speeds]}

    @classmethod
    def from_dict(cls, d: object, peers: int) -> "CompressionOptions":
        """The options in `d`, with a coding speed for each of `peers` peers or none; ValueError
        for anything else (every field checked)."""
        if not isinstance(d, dict) or set(d) != {"pp", "dp", "speed", "peer_speeds"}:
            raise ValueError("compression options are a map of pp, dp, speed and peer_speeds")
        speeds = [CodecSpeed.from_vector(_list(v, CODEC_SPEED_LEN)) for v in _list(d["peer_speeds"], peers)]
        if speeds and len(speeds) != peers:
            raise ValueError(f"compression options give {len(speeds)} coding speeds for {peers} peers")
        if not isinstance(d["speed"], dict):
            raise ValueError("the options' speed is a map of coding figures")
        return cls(tuple(_codec(PipelineCodec, c) for c in _list(d["pp"], 8)),
                   tuple(_codec(DataParallelCodec, c) for c in _list(d["dp"], 8)),
                   CodecSpeed.from_dict(d["speed"]), tuple(speeds))

    def of_peers(self, peers: Sequence[int]) -> "CompressionOptions":
        """The options for the network of `peers` (indices into this one's, in that order): the
        same codecs, each of those peers' own coding speed."""
        if not self.peer_speeds:
            return self
        return replace(self, peer_speeds=tuple(self.peer_speeds[int(i)] for i in peers))


def compression_options(names: Iterable[str], speed: CodecSpeed = CodecSpeed()) -> CompressionOptions:
    """Options with exact plus the codecs of the named presets (`WIRE_PRESETS`); "auto" names
    them all, "exact" none. ValueError for an unknown name."""
    chosen: list[str] = []
    for name in names:
        if name == "auto":
            chosen += list(WIRE_PRESETS)
        elif name in WIRE_PRESETS:
            chosen.append(name)
        else:
            raise ValueError(f"unknown compression {name!r}: choose auto, or presets from {', '.join(WIRE_PRESETS)}")
    pp = {c for n in chosen for c in [WIRE_PRESETS[n][0]] if not c.exact}
    dp = {c for n in chosen for c in [WIRE_PRESETS[n][1]] if not c.exact}
    return CompressionOptions(
        (PipelineCodec(),) + tuple(sorted(pp, key=lambda c: (_PP_RANK[c.method], c.name))),
        (DataParallelCodec(),) + tuple(sorted(dp, key=lambda c: (_DP_RANK[c.method], c.name))),
        speed)


@dataclass(frozen=True)
class CodecAssignment:
    """A codec for every pipeline link and every DP group of one (S, D) allocation."""

    pp: tuple[tuple[PipelineCodec, ...], ...]  # [s][p]: the link from stage s to s+1 of pipeline p
    dp: tuple[DataParallelCodec, ...]  # [s]: the DP group of stage s

    @classmethod
    def uniform(cls, stages: int, dp: int, pp_codec: PipelineCodec = PipelineCodec(),
                dp_codec: DataParallelCodec = DataParallelCodec()) -> "CodecAssignment":
        """`pp_codec` on every link, `dp_codec` on every group of more than one member (one
        pipeline's groups of one synchronise nothing: exact, as the trainer runs them)."""
        groups = dp_codec if dp > 1 else DataParallelCodec()
        return cls(tuple((pp_codec,) * dp for _ in range(stages - 1)), (groups,) * stages)

    @classmethod
    def chosen(cls, pp_codec: PipelineCodec, dp_codec: DataParallelCodec, pp_on: Sequence[Sequence[bool]],
               dp_on: Sequence[bool]) -> "CodecAssignment":
        """`pp_codec` on the links `pp_on` ([s][p]) marks, `dp_codec` on the groups `dp_on` ([s])
        marks, each other link and group exact: a per-link run's choice (`LinkCodecs`)."""
        return cls(tuple(tuple(pp_codec if on else type(pp_codec)() for on in row) for row in pp_on),
                   tuple(dp_codec if on else type(dp_codec)() for on in dp_on))

    @property
    def exact(self) -> bool:
        return all(c.exact for row in self.pp for c in row) and all(c.exact for c in self.dp)

    def to_dict(self) -> dict:
        """Plain data (for an allocation to carry): the distinct codecs once, then indices."""
        pp_codecs = sorted({c for row in self.pp for c in row}, key=lambda c: c.name)
        dp_codecs = sorted(set(self.dp), key=lambda c: c.name)
        return {"pp_codecs": [asdict(c) for c in pp_codecs], "dp_codecs": [asdict(c) for c in dp_codecs],
                "pp": [[pp_codecs.index(c) for c in row] for row in self.pp],
                "dp": [dp_codecs.index(c) for c in self.dp]}

    @classmethod
    def from_dict(cls, d: object, stages: int, dp: int) -> "CodecAssignment":
        """The assignment in `d` for an allocation of `stages` x `dp`; ValueError for anything
        else (every field checked: this may come from the network)."""
        if not isinstance(d, dict) or set(d) != {"pp_codecs", "dp_codecs", "pp", "dp"}:
            raise ValueError("a codec assignment is a map of pp_codecs, dp_codecs, pp and dp")
        pp_codecs = [_codec(PipelineCodec, c) for c in _list(d["pp_codecs"], 8)]
        dp_codecs = [_codec(DataParallelCodec, c) for c in _list(d["dp_codecs"], 8)]
        rows = _list(d["pp"], max(stages - 1, 0))
        if len(rows) != stages - 1:
            raise ValueError(f"a codec assignment for {stages} stages has {stages - 1} rows of links, got {len(rows)}")
        pp = tuple(tuple(_pick(pp_codecs, k) for k in _list(row, dp)) for row in rows)
        groups = tuple(_pick(dp_codecs, k) for k in _list(d["dp"], stages))
        out = cls(pp, groups)
        out.check(stages, dp)
        return out

    def check(self, stages: int, dp: int) -> None:
        if len(self.dp) != stages or len(self.pp) != stages - 1 or any(len(r) != dp for r in self.pp):
            raise ValueError(f"a codec assignment for {stages} stages x {dp} pipelines needs {stages - 1} x {dp} "
                             f"links and {stages} groups")


def _list(v: object, limit: int) -> list:
    if not isinstance(v, list) or len(v) > limit:
        raise ValueError(f"expected a list of at most {limit} items")
    return v


def _pick(codecs: list[C], k: object) -> C:
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < len(codecs):
        raise ValueError(f"codec index {k!r} is not one of the {len(codecs)} listed")
    return codecs[k]


C = TypeVar("C", PipelineCodec, DataParallelCodec)

_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {"str": str, "bool": bool, "int": int, "float": (int, float)}


_LATER_FIELDS = frozenset({"overlap_steps"})  # fields a stored codec may lack (they take their default)


def _codec(kind: type[C], d: object) -> C:
    names = {f.name: f.type for f in fields(kind)}
    # (a codec written before overlap_steps existed has none: 0)
    if not isinstance(d, dict) or not set(names) - _LATER_FIELDS <= set(d) <= set(names):
        raise ValueError(f"a {kind.__name__} is a map of {sorted(names)}")
    for k, v in d.items():
        want = _FIELD_TYPES[str(names[k])]
        if not isinstance(v, want) or (isinstance(v, bool) and want is not bool):
            raise ValueError(f"{kind.__name__}.{k} = {v!r} has the wrong type")
    return kind(**d)
