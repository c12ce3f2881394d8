"""The wire codec: msgpack with hard limits, field checkers.

`unpack_untrusted` is the only place that decodes msgpack from the network. It raises only
`ProtocolError`, whatever the input, and bounds memory and time by the input length:

- the input length is checked first (`max_len`), before any decoding;
- array/map/str/bin headers may not claim more elements than there are bytes left, so a
  header announcing 2^32-1 elements is refused before anything is allocated;
- every array and map counts against a container budget (`max_containers`), so a frame full
  of 0x90 (one empty array per byte) stops after a few thousand lists, not millions;
- nesting is limited (`max_depth`), map keys must be `str`, floats must be finite, and ext
  types (including msgpack timestamps) are refused.

Message types are small ints. Each subsystem owns a range and keeps its own append-only IntEnum:
0-31 transport/daemon (dtfm.peer), 32-63 gossip, 64-95 control plane, 96-127 training.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack

from .errors import ProtocolError

MSG_TYPE_RANGES: dict[str, range] = {
    "peer": range(0, 32),
    "gossip": range(32, 64),
    "control": range(64, 96),
    "train": range(96, 128),
}
MAX_MSG_TYPE = 255

DEFAULT_MAX_DEPTH = 32
DEFAULT_MAX_CONTAINERS = 16384

_SCALAR_TYPES = frozenset({int, float, bool, str, bytes, type(None)})
_NUMERIC_TYPES = frozenset({int, float, bool})


def pack(obj: Any) -> bytes:
    """msgpack-encode `obj` (str as str, bytes as bin; no ext types)."""
    try:
        return msgpack.packb(obj, use_bin_type=True, datetime=False)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"cannot encode {type(obj).__name__} for the wire: {e}") from None


_READ_SIZE = 256 * 1024


class _SliceReader:
    """File-like view of a buffer, handing msgpack slices without copying the whole input."""

    __slots__ = ("_view", "_pos")

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def read(self, size: int = -1) -> bytes:
        start = self._pos
        end = len(self._view) if size < 0 else min(len(self._view), start + size)
        self._pos = end
        return bytes(self._view[start:end])


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} not allowed")


def unpack_untrusted(
    data: bytes | bytearray | memoryview,
    *,
    max_len: int,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_containers: int = DEFAULT_MAX_CONTAINERS,
) -> object:
    """Decode one msgpack object from untrusted `data`; raises only `ProtocolError`."""
    n = len(data)
    if n > max_len:
        raise ProtocolError(f"message of {n} bytes exceeds the limit of {max_len}")
    if n == 0:
        raise ProtocolError("empty message")
    budget = [max_containers]

    def count(container: Any) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise ProtocolError(f"more than {max_containers} arrays/maps in one message")
        return container

    # A streaming Unpacker fed in slices: unlike unpackb, trailing garbage is detected by
    # position instead of being copied into the exception, and the internal buffer stays
    # bounded by the largest single str/bin in the message.
    unpacker = msgpack.Unpacker(
        _SliceReader(data),
        read_size=min(n, _READ_SIZE),
        max_buffer_size=n,
        raw=False,
        strict_map_key=True,
        use_list=True,
        list_hook=count,
        object_hook=count,
        ext_hook=_refuse_ext,
        timestamp=0,
        max_str_len=n,
        max_bin_len=n,
        max_array_len=n,
        max_map_len=n,
        max_ext_len=0,
    )
    try:
        obj = unpacker.unpack()
        if unpacker.tell() != n:
            raise ProtocolError(f"{n - unpacker.tell()} trailing bytes after the message")
    except ProtocolError:
        raise
    except msgpack.OutOfData:
        raise ProtocolError("truncated message") from None
    except msgpack.StackError:
        raise ProtocolError("message nested too deeply") from None
    except RecursionError:
        raise ProtocolError("message nested too deeply") from None
    except MemoryError:
        raise ProtocolError("message too large to decode") from None
    except Exception as e:  # msgpack raises ValueError, FormatError, UnicodeDecodeError, ...
        raise ProtocolError(f"malformed msgpack: {type(e).__name__}: {e}") from None
    _check_tree(obj, max_depth)
    return obj


def _check_tree(root: Any, max_depth: int) -> None:
    """Refuse non-str map keys, non-finite floats, deep nesting and unexpected types."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        t = type(node)
        if t is dict:
            keys = node.keys()
            if set(map(type, keys)) - {str}:
                raise ProtocolError("map keys must be strings")
            values = node.values()
        elif t is list:
            values = node
        elif t is float:
            if not math.isfinite(node):
                raise ProtocolError("non-finite float")
            continue
        elif t in _SCALAR_TYPES:
            continue
        else:
            raise ProtocolError(f"unexpected value type {t.__name__}")
        if depth > max_depth:
            raise ProtocolError(f"message nested deeper than {max_depth}")
        types = set(map(type, values))
        if types <= _NUMERIC_TYPES:
            if float in types and not all(map(math.isfinite, values)):
                raise ProtocolError("non-finite float")
            continue
        if types <= _SCALAR_TYPES - {float}:
            continue
        for v in values:
            if type(v) in (dict, list, float) or type(v) not in _SCALAR_TYPES:
                stack.append((v, depth + 1))


# ----------------------------------------------------------------------------- field checkers


def _field(d: Any, key: str) -> Any:
    if not isinstance(d, Mapping):
        raise ProtocolError(f"expected a map, got {type(d).__name__}")
    try:
        return d[key]
    except KeyError:
        raise ProtocolError(f"missing field {key!r}") from None


def get_dict(obj: Any, what: str = "message") -> dict:
    """`obj` itself, checked to be a map (the usual top level of a message body)."""
    if type(obj) is not dict:
        raise ProtocolError(f"{what}: expected a map, got {type(obj).__name__}")
    return obj


def get_int(d: dict, key: str, lo: int, hi: int) -> int:
    v = _field(d, key)
    if type(v) is not int:
        raise ProtocolError(f"field {key!r}: expected an int, got {type(v).__name__}")
    if v < lo or v > hi:
        raise ProtocolError(f"field {key!r}: {v} outside [{lo}, {hi}]")
    return v


def get_float(d: dict, key: str, lo: float, hi: float) -> float:
    """A finite number in [lo, hi]; ints are accepted and returned as float."""
    v = _field(d, key)
    if type(v) not in (int, float):
        raise ProtocolError(f"field {key!r}: expected a number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v):
        raise ProtocolError(f"field {key!r}: not a finite number")
    if v < lo or v > hi:
        raise ProtocolError(f"field {key!r}: {v} outside [{lo}, {hi}]")
    return v


def get_bool(d: dict, key: str) -> bool:
    v = _field(d, key)
    if type(v) is not bool:
        raise ProtocolError(f"field {key!r}: expected a bool, got {type(v).__name__}")
    return v


def get_str(d: dict, key: str, max_len: int) -> str:
    v = _field(d, key)
    if type(v) is not str:
        raise ProtocolError(f"field {key!r}: expected a string, got {type(v).__name__}")
    if len(v) > max_len:
        raise ProtocolError(f"field {key!r}: string longer than {max_len}")
    return v


def get_bytes(d: dict, key: str, min_len: int, max_len: int) -> bytes:
    v = _field(d, key)
    if type(v) is not bytes:
        raise ProtocolError(f"field {key!r}: expected bytes, got {type(v).__name__}")
    if len(v) < min_len or len(v) > max_len:
        raise ProtocolError(f"field {key!r}: {len(v)} bytes, expected {min_len}..{max_len}")
    return v


def get_list(d: dict, key: str, max_len: int) -> list:
    v = _field(d, key)
    if type(v) is not list:
        raise ProtocolError(f"field {key!r}: expected a list, got {type(v).__name__}")
    if len(v) > max_len:
        raise ProtocolError(f"field {key!r}: list longer than {max_len}")
    return v
