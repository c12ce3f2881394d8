"""Torch tensors to and from the wire: a `dtfm.net` tensor header plus the raw bytes.

The transport layer owns the format: which dtypes may travel (`TENSOR_ITEMSIZE`), the header
(`tensor_header`) and the bounded check of a received header against its payload
(`check_tensor`). This module only maps it onto torch, so the two cannot disagree on what
travels: `TORCH_DTYPES` is every wire dtype torch can represent, derived from the net's table.

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

from dtfm.net import TENSOR_ITEMSIZE, ProtocolError, check_tensor, tensor_header

__all__ = ["TORCH_DTYPES", "tensor_from_wire", "tensor_to_wire"]

# Wire dtype name -> torch dtype: exactly the wire's dtypes that torch has, under the same name.
TORCH_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    name: dt for name in TENSOR_ITEMSIZE
    if isinstance(dt := getattr(torch, name, None), torch.dtype) and dt.itemsize == TENSOR_ITEMSIZE[name]
})
_WIRE_NAMES = {dt: name for name, dt in TORCH_DTYPES.items()}


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
    return header, memoryview(flat.view(torch.uint8).numpy())


def tensor_from_wire(
    header: object, payload: bytes | bytearray | memoryview | None, *, max_bytes: int
) -> torch.Tensor:
    """The tensor a received header and payload describe; raises only ProtocolError.

    Everything is checked (by `check_tensor`) before anything is allocated. A writable payload
    becomes the tensor's memory without a copy, so the caller must not reuse it afterwards.
    """
    name, shape = check_tensor(header, payload, max_bytes=max_bytes)
    dt = TORCH_DTYPES.get(name)
    if dt is None:
        raise ProtocolError(f"tensor dtype {name!r} travels on the wire but has no torch type")
    view = memoryview(payload)
    if view.readonly or not view.c_contiguous:
        view = memoryview(bytearray(view))
    if view.nbytes == 0:
        return torch.empty(shape, dtype=dt)
    raw = torch.frombuffer(view.cast("B"), dtype=torch.uint8)
    if raw.data_ptr() % dt.itemsize:
        raw = raw.clone()  # a fresh allocation is aligned for every dtype
    if dt is torch.bool and bool(raw.gt(1).any()):
        raise ProtocolError("bool tensor with bytes other than 0 and 1")
    return raw.view(dt).reshape(shape)
