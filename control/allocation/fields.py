"""The fields of a signed allocation (allocation.py beside it): their bounds and checks, the
holdings of the previous layout, and the wire form of the model and training configuration.

A configuration (`GPTSpec`, `TrainConfig`, `CompressionConfig`) travels as a map with sorted keys, every field a
bool, int, float (as float64) or str within generous bounds (the dataclasses check the rest);
`config_from_wire` refuses a missing, unknown or mistyped field with a `ProtocolError`. The
`check_*` functions raise ValueError, for the dataclasses' own checks. The allocation's format
is in docs/control.md.
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass, fields
from typing import TypeVar

from dtfm.net import PEER_ID_BYTES, ProtocolError, get_bool, get_bytes, get_dict, get_float, get_int, get_list, get_str
from dtfm.train import CompressionConfig, GPTSpec, TrainConfig

__all__ = [
    "MAX_COUNTER", "MAX_DATA_NAME_LEN", "MAX_HOLDERS", "MAX_ITERATION_S", "MAX_LAYERS", "MAX_NAMED",
    "MAX_OPERATOR_START_BYTES", "MAX_PEERS",
    "MAX_PRESET_LEN", "MAX_REASON_LEN", "MAX_STAGES", "RUN_ID_BYTES", "SHA256_HEX", "SIGNATURE_BYTES", "Holding",
    "check_bytes", "check_int", "check_str", "config_from_wire", "config_to_wire", "layer_range_from_wire",
    "peer_ids_from_wire",
]

MAX_PEERS = 4096  # pipeline peers and spares together
MAX_STAGES = 1024
MAX_LAYERS = 1 << 16
MAX_COUNTER = 2**63 - 1  # epochs, terms, steps
MAX_ITERATION_S = 1e9
MAX_PRESET_LEN = 64
MAX_DATA_NAME_LEN = 256
RUN_ID_BYTES = 16
SIGNATURE_BYTES = 64
MAX_REASON_LEN = 1024
MAX_OPERATOR_START_BYTES = 8192  # the run's signed start (control/operator.py)
MAX_HOLDERS = 64  # holders listed per stage of the previous layout
MAX_NAMED = 8  # peers named in one refusal; the rest are counted
# Model and train configuration values: generous bounds, the dataclasses check the rest.
MAX_CONFIG_FIELDS = 64
MAX_CONFIG_INT = 2**53
MAX_CONFIG_FLOAT = 1e15
MAX_CONFIG_STR = 256

SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def check_int(what: str, v: object, lo: int, hi: int) -> None:
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{what} must be an integer in [{lo}, {hi}], got {v!r}")


def check_bytes(what: str, v: object, n: int) -> None:
    if type(v) is not bytes or len(v) != n:
        raise ValueError(f"{what} must be {n} bytes, got {v!r:.80}")


def check_str(what: str, v: object, lo: int, hi: int) -> None:
    if type(v) is not str or not lo <= len(v) <= hi:
        raise ValueError(f"{what} must be a string of {lo} to {hi} characters, got {v!r:.80}")


def peer_ids_from_wire(obj: object, what: str, max_len: int) -> list[bytes]:
    """A list of at most `max_len` peer ids; raises only ProtocolError."""
    items = get_list({what: obj}, what, max_len)
    return [get_bytes({what: x}, what, PEER_ID_BYTES, PEER_ID_BYTES) for x in items]


@dataclass(frozen=True)
class Holding:
    """Where a stage of the previous layout is held at the allocation's start step: the peers
    that hold it (or its checkpoint) and the sha256 digest of its transfer manifest
    (`control.recovery.manifest_digest`), which binds every chunk a peer fetches."""

    layer_range: tuple[int, int]
    digest: str
    holders: tuple[bytes, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_range", tuple(self.layer_range))
        object.__setattr__(self, "holders", tuple(self.holders))
        if len(self.layer_range) != 2:
            raise ValueError(f"layer range {self.layer_range!r} is not a pair")
        for layer in self.layer_range:
            check_int("layer", layer, 0, MAX_LAYERS)
        if type(self.digest) is not str or not SHA256_HEX.fullmatch(self.digest):
            raise ValueError(f"holding digest must be 64 lowercase hex characters, got {self.digest!r:.80}")
        if not 1 <= len(self.holders) <= MAX_HOLDERS:
            raise ValueError(f"a holding lists 1 to {MAX_HOLDERS} holders")
        for x in self.holders:
            check_bytes("holder", x, PEER_ID_BYTES)
        if len(set(self.holders)) != len(self.holders):
            raise ValueError("a holder is listed twice")

    def to_wire(self) -> list:
        return [self.layer_range[0], self.layer_range[1], self.digest, list(self.holders)]

    @classmethod
    def from_wire(cls, obj: object) -> Holding:
        """A holding from its [first, end, digest, holders] list; raises only ProtocolError."""
        items = get_list({"holding": obj}, "holding", 4)
        if len(items) != 4:
            raise ProtocolError("holding: expected [first, end, digest, holders]")
        d = dict(zip(("first layer", "end layer", "digest", "holders"), items))
        try:
            return cls((get_int(d, "first layer", 0, MAX_LAYERS), get_int(d, "end layer", 0, MAX_LAYERS)),
                       get_str(d, "digest", 64), tuple(peer_ids_from_wire(d["holders"], "holders", MAX_HOLDERS)))
        except ValueError as e:
            raise ProtocolError(f"holding: {e}") from None


def layer_range_from_wire(obj: object) -> tuple[int, int]:
    """A [first, end] pair of layer indices; raises only ProtocolError (the order is the
    allocation's to check)."""
    pair = get_list({"layer range": obj}, "layer range", 2)
    if len(pair) != 2:
        raise ProtocolError("layer range: expected [first, end]")
    d = dict(zip(("first layer", "end layer"), pair))
    return get_int(d, "first layer", 0, MAX_LAYERS), get_int(d, "end layer", 0, MAX_LAYERS)


Config = TypeVar("Config", GPTSpec, TrainConfig, CompressionConfig)


_SCHEMAS: dict[type, tuple[tuple[str, type], ...]] = {}
# Fields an allocation carries elsewhere: a per-link compression is told by the allocation's
# `compress_links` field being there (format 5), so a format-4 compression map keeps its bytes.
_OMITTED: dict[type, tuple[str, ...]] = {CompressionConfig: ("per_link",)}
# Fields that travel only where they differ from the default, so an allocation without them has
# the bytes it had before they existed: a bf16 run's train map says "precision", an fp32 one's
# does not. A map without the field gets the default.
_OPTIONAL: dict[type, frozenset[str]] = {TrainConfig: frozenset({"precision", "pipeline_warmups"}),
                                         CompressionConfig: frozenset({"dp_ramp_syncs", "dp_overlap_steps"})}


def _schema(cls: type[GPTSpec] | type[TrainConfig] | type[CompressionConfig]) -> tuple[tuple[str, type], ...]:
    """(name, type) of each field of a config dataclass, sorted by name (the wire's key order)."""
    schema = _SCHEMAS.get(cls)
    if schema is None:
        hints = typing.get_type_hints(cls)
        out = []
        for f in sorted(fields(cls), key=lambda f: f.name):
            if f.name in _OMITTED.get(cls, ()):
                continue
            if hints[f.name] not in (bool, int, float, str):
                raise TypeError(f"{cls.__name__}.{f.name}: a {hints[f.name]} field cannot travel in an allocation")
            out.append((f.name, hints[f.name]))
        schema = _SCHEMAS[cls] = tuple(out)
    return schema


def config_to_wire(cfg: GPTSpec | TrainConfig | CompressionConfig, what: str) -> dict:
    """The config as a map with sorted keys; ValueError on a value the wire would refuse."""
    out = {}
    optional = _OPTIONAL.get(type(cfg), frozenset())
    for name, kind in _schema(type(cfg)):
        v = getattr(cfg, name)
        if name in optional and v == _default(type(cfg), name):
            continue
        if not _fits(kind, v):
            raise ValueError(f"{what}.{name} = {v!r:.80} cannot travel in an allocation")
        out[name] = float(v) if kind is float else v
    return out


def _default(cls: type, name: str) -> object:
    return next(f.default for f in fields(cls) if f.name == name)


def _fits(kind: type, v: object) -> bool:
    if kind is float:
        return (type(v) is int or type(v) is float) and math.isfinite(v) and abs(v) <= MAX_CONFIG_FLOAT
    if kind is int:
        return type(v) is int and 0 <= v <= MAX_CONFIG_INT
    if kind is str:
        return type(v) is str and len(v) <= MAX_CONFIG_STR
    return type(v) is bool


def config_from_wire(cls: type[Config], obj: object, what: str) -> Config:
    """A GPTSpec, TrainConfig or CompressionConfig from its map; every field present, typed and in bounds."""
    d = get_dict(obj, what)
    schema = _schema(cls)
    if len(d) > MAX_CONFIG_FIELDS:
        raise ProtocolError(f"{what}: more than {MAX_CONFIG_FIELDS} fields")
    unknown = sorted(set(d) - {name for name, _ in schema})
    if unknown:
        raise ProtocolError(f"{what}: unknown fields {unknown[:MAX_NAMED]}: run the same dtfm version on every peer")
    values: dict[str, object] = {}
    optional = _OPTIONAL.get(cls, frozenset())
    for name, kind in schema:
        if name in optional and name not in d:
            continue  # the dataclass's default
        if kind is bool:
            values[name] = get_bool(d, name)
        elif kind is int:
            values[name] = get_int(d, name, 0, MAX_CONFIG_INT)
        elif kind is float:
            values[name] = get_float(d, name, -MAX_CONFIG_FLOAT, MAX_CONFIG_FLOAT)
        else:
            values[name] = get_str(d, name, MAX_CONFIG_STR)
    try:
        return cls.from_dict(values)
    except (ValueError, TypeError) as e:
        raise ProtocolError(f"{what}: {e}") from None
