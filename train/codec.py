"""Torch tensors to and from the wire: the tensor header, its bounded check, the raw bytes.

A tensor travels as a header {"dtype": name, "shape": [dims]} in a message body and its
elements, row-major and little-endian, as the message payload. This module owns that format:
which dtypes may travel (`TENSOR_ITEMSIZE`, by name and item size), the header
(`tensor_header`), the bounded check of a received header against its payload
(`check_tensor`, which raises only `CodecError`), and its mapping onto torch (`TORCH_DTYPES`,
every wire dtype torch has, checked against the table). The transport carries headers and
payloads without knowing what they are; the data plane (dtfm.control) turns a `CodecError`
from the network into a refusal of that tensor.

Both directions avoid copies where they can. `tensor_to_wire` returns a byte view of the tensor
itself when it already is a contiguous CPU tensor; `tensor_from_wire` builds the tensor on the
caller's buffer when that buffer is writable (a received payload is a writable memoryview that
the caller hands over), and copies only a read-only or misaligned one. Elements are
little-endian on the wire, which is torch's byte order on every platform it supports.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

__all__ = [
    "MAX_TENSOR_DIMS", "TENSOR_ITEMSIZE", "TORCH_DTYPES", "CodecError", "check_tensor", "tensor_from_wire",
    "tensor_header", "tensor_to_wire",
]


class CodecError(ValueError):
    """A received tensor header or payload is malformed (untrusted input: the caller maps it
    onto its own protocol error)."""


# Every dtype a tensor may travel as, with its item size in bytes; anything else is refused.
TENSOR_ITEMSIZE: Mapping[str, int] = MappingProxyType({
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
})
MAX_TENSOR_DIMS = 8
_MAX_DTYPE_CHARS = 16

# Wire dtype name -> torch dtype: exactly the wire's dtypes that torch has, under the same name.
TORCH_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    name: dt for name in TENSOR_ITEMSIZE
    if isinstance(dt := getattr(torch, name, None), torch.dtype) and dt.itemsize == TENSOR_ITEMSIZE[name]
})
_WIRE_NAMES = {dt: name for name, dt in TORCH_DTYPES.items()}


def tensor_header(dtype: str, shape: tuple[int, ...]) -> dict:
    """The msgpack-able header describing a tensor sent as raw little-endian bytes."""
    if dtype not in TENSOR_ITEMSIZE:
        raise ValueError(f"dtype {dtype!r} cannot travel on the wire")
    if len(shape) > MAX_TENSOR_DIMS or any(type(s) is not int or s < 0 for s in shape):
        raise ValueError(f"bad tensor shape {shape!r}")
    return {"dtype": dtype, "shape": list(shape)}


def _field(header: dict, key: str) -> object:
    try:
        return header[key]
    except KeyError:
        raise CodecError(f"missing field {key!r}") from None


def check_tensor(
    header: object, payload: bytes | bytearray | memoryview | None, *, max_bytes: int
) -> tuple[str, tuple[int, ...]]:
    """Check a received tensor header against its payload; returns (dtype, shape).

    Raises only `CodecError`. The shape is bounded by `max_bytes` dimension by dimension,
    in Python ints, zero dimensions counted as one: a hostile shape can neither overflow nor
    hide behind a zero (an empty tensor of shape (0, 2^40, 2^40) is refused too), so no
    stride of an accepted shape exceeds `max_bytes`."""
    if type(header) is not dict:
        raise CodecError(f"tensor header: expected a map, got {type(header).__name__}")
    dtype = _field(header, "dtype")
    if type(dtype) is not str:
        raise CodecError(f"field 'dtype': expected a string, got {type(dtype).__name__}")
    if len(dtype) > _MAX_DTYPE_CHARS:
        raise CodecError(f"field 'dtype': string longer than {_MAX_DTYPE_CHARS}")
    itemsize = TENSOR_ITEMSIZE.get(dtype)
    if itemsize is None:
        raise CodecError(f"tensor dtype {dtype!r} not allowed")
    dims = _field(header, "shape")
    if type(dims) is not list:
        raise CodecError(f"field 'shape': expected a list, got {type(dims).__name__}")
    if len(dims) > MAX_TENSOR_DIMS:
        raise CodecError(f"field 'shape': list longer than {MAX_TENSOR_DIMS}")
    numel, span = 1, itemsize  # span: bytes of the shape with its zero dimensions as one
    if span > max_bytes:
        raise CodecError(f"tensor dtype {dtype!r} is larger than {max_bytes} bytes")
    for s in dims:
        if type(s) is not int or s < 0:
            raise CodecError(f"bad tensor dimension {s!r}")
        span *= max(s, 1)
        if span > max_bytes:
            raise CodecError(f"tensor shape spans more than {max_bytes} bytes")
        numel *= s
    if payload is None:
        raise CodecError("tensor header without payload")
    nbytes = numel * itemsize
    got = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    if got != nbytes:
        raise CodecError(f"tensor payload is {got} bytes, header says {nbytes}")
    return dtype, tuple(dims)


def tensor_to_wire(t: torch.Tensor) -> tuple[dict, memoryview]:
    """(header, payload) for `t`: the header for the message body, its bytes as the payload.

    The payload is a view of `t`'s own memory when `t` is a contiguous CPU tensor (otherwise of
    a contiguous CPU copy): keep `t` unchanged until the bytes are written, or copy them.
    Raises ValueError for a dtype that cannot travel (a caller's mistake, not the network's).
    """
    name = _WIRE_NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"dtype {t.dtype} cannot travel on the wire (allowed: {', '.join(TORCH_DTYPES)})")
    header = tensor_header(name, tuple(t.shape))
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return header, memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # an ndarray is a buffer


def tensor_from_wire(
    header: object, payload: bytes | bytearray | memoryview | None, *, max_bytes: int
) -> torch.Tensor:
    """The tensor a received header and payload describe; raises only CodecError.

    Everything is checked (by `check_tensor`) before anything is allocated. A writable payload
    becomes the tensor's memory without a copy, so the caller must not reuse it afterwards.
    """
    name, shape = check_tensor(header, payload, max_bytes=max_bytes)
    if payload is None:  # refused by check_tensor already: this tells the type checker
        raise CodecError("tensor header without payload")
    dt = TORCH_DTYPES.get(name)
    if dt is None:
        raise CodecError(f"tensor dtype {name!r} travels on the wire but has no torch type")
    view = memoryview(payload)
    if view.readonly or not view.c_contiguous:
        view = memoryview(bytearray(view))
    if view.nbytes == 0:
        return torch.empty(shape, dtype=dt)
    raw = torch.frombuffer(view.cast("B"), dtype=torch.uint8)
    if raw.data_ptr() % dt.itemsize:
        raw = raw.clone()  # a fresh allocation is aligned for every dtype
    if dt is torch.bool and bool(raw.gt(1).any()):
        raise CodecError("bool tensor with bytes other than 0 and 1")
    return raw.view(dt).reshape(shape)
