"""The tensor wire format (train/codec.py): the header, its bounded check, torch tensors to and
from raw bytes; garbage in raises only CodecError."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import wire_values

from dtfm.net import pack, unpack_untrusted
from dtfm.train import (
    MAX_TENSOR_DIMS,
    TENSOR_ITEMSIZE,
    TORCH_DTYPES,
    CodecError,
    InMemoryHub,
    check_tensor,
    tensor_from_wire,
    tensor_header,
    tensor_to_wire,
)
from dtfm.train.spec import WIRE_DTYPES

MiB = 1 << 20



@pytest.mark.parametrize("name", sorted(TENSOR_ITEMSIZE))
def test_every_wire_dtype_round_trips_through_torch(name):
    """Torch has every wire dtype, and each round-trips byte for byte."""
    dt = TORCH_DTYPES[name]
    assert dt.itemsize == TENSOR_ITEMSIZE[name]
    t = (torch.arange(24) % 7 - 3).to(dt).reshape(2, 3, 4)
    header, payload = tensor_to_wire(t)
    assert header == tensor_header(name, (2, 3, 4))
    assert payload.nbytes == 24 * TENSOR_ITEMSIZE[name]
    body = unpack_untrusted(pack({"t": header}), max_len=1024)["t"]  # as it would arrive
    back = tensor_from_wire(body, bytearray(payload), max_bytes=payload.nbytes)
    assert back.dtype == dt and back.shape == t.shape and torch.equal(back, t)


def test_torch_dtypes_are_the_wire_dtypes_and_cover_training():
    assert set(TORCH_DTYPES) == set(TENSOR_ITEMSIZE)
    assert set(WIRE_DTYPES) <= set(TORCH_DTYPES)
    with pytest.raises(ValueError, match="cannot travel"):
        tensor_to_wire(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="cannot travel"):
        InMemoryHub().endpoint("a").isend("b", "t", torch.zeros(2, dtype=torch.uint16))


def test_tensor_to_wire_views_a_contiguous_tensor_and_copies_otherwise():
    t = torch.zeros(4)
    _, view = tensor_to_wire(t)
    t[0] = 1.0
    assert bytes(view[:4]) == torch.tensor([1.0]).numpy().tobytes()  # no copy was made
    u = torch.arange(6.0).reshape(2, 3).T  # not contiguous
    header, view = tensor_to_wire(u)
    assert header["shape"] == [3, 2]
    assert torch.equal(tensor_from_wire(header, bytes(view), max_bytes=24), u)
    scalar = torch.tensor(2.5, dtype=torch.bfloat16, requires_grad=True)
    header, view = tensor_to_wire(scalar)
    assert header["shape"] == [] and tensor_from_wire(header, bytes(view), max_bytes=2).item() == 2.5


def test_tensor_from_wire_uses_a_writable_buffer_without_copying():
    buf = bytearray(torch.arange(4, dtype=torch.int32).numpy().tobytes())
    t = tensor_from_wire(tensor_header("int32", (2, 2)), buf, max_bytes=16)
    buf[0] = 9
    assert t[0, 0].item() == 9  # the tensor lives in the caller's buffer
    ro = bytes(buf)
    t = tensor_from_wire(tensor_header("int32", (4,)), ro, max_bytes=16)  # read-only: copied
    t[0] = 5
    assert ro[0] == 9
    odd = memoryview(bytearray(17))[1:]  # misaligned for float64: copied, still correct
    odd[8:16] = torch.tensor([1.5], dtype=torch.float64).numpy().tobytes()
    assert tensor_from_wire(tensor_header("float64", (2,)), odd, max_bytes=16).tolist() == [0.0, 1.5]
    assert tensor_from_wire(tensor_header("float32", (0, 3)), b"", max_bytes=16).shape == (0, 3)


def test_tensor_from_wire_limits():
    with pytest.raises(CodecError, match="spans more"):
        tensor_from_wire(tensor_header("float32", (1 << 30,)), b"", max_bytes=1 << 20)
    with pytest.raises(CodecError, match="not allowed"):
        tensor_from_wire({"dtype": "object", "shape": [1]}, b"\0" * 8, max_bytes=64)
    with pytest.raises(CodecError, match="spans more"):  # 2**64 elements must not wrap around to 0
        tensor_from_wire(tensor_header("float32", (1 << 32, 1 << 32)), b"", max_bytes=64)
    with pytest.raises(CodecError, match="spans more"):  # empty, but torch could not stride it
        tensor_from_wire(tensor_header("uint8", (0, 1 << 40, 1 << 40)), b"", max_bytes=1 << 62)
    with pytest.raises(CodecError, match="0 and 1"):
        tensor_from_wire(tensor_header("bool", (2,)), b"\x01\x02", max_bytes=64)


garbage_headers = st.fixed_dictionaries({
    "dtype": st.sampled_from(sorted(TENSOR_ITEMSIZE)) | st.text(max_size=10) | st.integers(),
    "shape": st.lists(st.integers(-5, 1 << 64) | st.booleans() | st.none(), max_size=10) | st.none(),
}) | st.none() | st.lists(st.integers(), max_size=3) | st.text(max_size=10)


@settings(max_examples=300, deadline=None)
@given(garbage_headers, st.binary(max_size=64) | st.none())
def test_garbage_tensor_from_wire_raises_codec_error_only(header, data):
    try:
        t = tensor_from_wire(header, None if data is None else bytearray(data), max_bytes=64)
    except CodecError:
        return
    assert t.numel() * t.element_size() == len(data)
    assert tuple(t.shape) == tuple(header["shape"]) and t.dtype == TORCH_DTYPES[header["dtype"]]


def test_tensor_header_and_check():
    h = unpack_untrusted(pack(tensor_header("float32", (2, 3))), max_len=MiB)
    assert check_tensor(h, b"\0" * 24, max_bytes=1024) == ("float32", (2, 3))
    with pytest.raises(CodecError):
        check_tensor(h, b"\0" * 23, max_bytes=1024)
    with pytest.raises(CodecError):
        check_tensor(h, b"\0" * 24, max_bytes=16)
    with pytest.raises(CodecError):
        check_tensor({"dtype": "object", "shape": [1]}, b"\0" * 8, max_bytes=1024)
    with pytest.raises(CodecError):
        check_tensor({"dtype": "uint8", "shape": [-1]}, b"", max_bytes=1024)
    with pytest.raises(CodecError):
        check_tensor({"dtype": "uint8", "shape": [2**40, 2**40]}, b"", max_bytes=2**62)
    with pytest.raises(CodecError):
        check_tensor({"dtype": "uint8", "shape": [1] * 9}, b"\0", max_bytes=1024)
    with pytest.raises(CodecError):  # empty, but its strides would not fit in 64 bits
        check_tensor({"dtype": "uint8", "shape": [0, 2**40, 2**40]}, b"", max_bytes=2**62)
    with pytest.raises(CodecError):
        check_tensor(h, None, max_bytes=1024)
    with pytest.raises(CodecError):
        check_tensor([h], b"\0" * 24, max_bytes=1024)
    with pytest.raises(CodecError):
        check_tensor({"dtype": "uint8", "shape": [True]}, b"\0", max_bytes=1024)
    with pytest.raises(ValueError):
        tensor_header("object", (1,))
    with pytest.raises(ValueError):
        tensor_header("uint8", (-1,))


def test_tensor_payload_length_is_counted_in_bytes():
    h = tensor_header("float32", (4,))
    floats = memoryview(bytearray(16)).cast("f")  # 4 items, 16 bytes
    assert check_tensor(h, floats, max_bytes=16) == ("float32", (4,))


tensor_shapes = st.lists(st.integers(0, 5), max_size=MAX_TENSOR_DIMS).map(tuple)


@settings(deadline=None)
@given(st.sampled_from(sorted(TENSOR_ITEMSIZE)), tensor_shapes)
def test_every_dtype_header_round_trips(dtype, shape):
    itemsize = TENSOR_ITEMSIZE[dtype]
    nbytes = math.prod(shape) * itemsize
    span = math.prod(max(s, 1) for s in shape) * itemsize  # what the limit is checked against
    h = unpack_untrusted(pack(tensor_header(dtype, shape)), max_len=MiB)
    assert check_tensor(h, bytes(nbytes), max_bytes=span) == (dtype, shape)
    with pytest.raises(CodecError):
        check_tensor(h, bytes(nbytes), max_bytes=span - 1)
    with pytest.raises(CodecError):
        check_tensor(h, bytes(nbytes + itemsize), max_bytes=span + itemsize)


garbage_header_values = wire_values | st.fixed_dictionaries({
    "dtype": st.sampled_from(sorted(TENSOR_ITEMSIZE)) | st.text(max_size=20) | wire_values,
    "shape": st.lists(st.integers(-3, 2**64 - 1) | wire_values, max_size=12) | wire_values,
})


@settings(max_examples=300, deadline=None)
@given(garbage_header_values, st.binary(max_size=64) | st.none())
def test_garbage_tensor_headers_raise_only_codec_error(header, payload):
    try:
        dtype, shape = check_tensor(header, payload, max_bytes=64)
    except CodecError:
        return
    assert math.prod(shape) * TENSOR_ITEMSIZE[dtype] == len(payload) <= 64
    assert math.prod(max(s, 1) for s in shape) * TENSOR_ITEMSIZE[dtype] <= 64
