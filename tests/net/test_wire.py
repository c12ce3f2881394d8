import math
import tracemalloc

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import wire_values

from dtfm.net.errors import ProtocolError
from dtfm.net.wire import (
    get_bytes,
    get_float,
    get_int,
    get_list,
    get_str,
    pack,
    unpack_untrusted,
)

MiB = 1 << 20



@settings(deadline=None)
@given(wire_values)
def test_round_trip(value):
    assert unpack_untrusted(pack(value), max_len=MiB) == value


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_protocol_error(data):
    try:
        unpack_untrusted(data, max_len=MiB)
    except ProtocolError:
        pass


@settings(deadline=None)
@given(wire_values, st.data())
def test_truncation_is_refused(value, data):
    encoded = pack(value)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(ProtocolError):
        unpack_untrusted(encoded[:cut], max_len=MiB)


def _bombs():
    return {
        "50 MB of 0x90": b"\x90" * 50_000_000,
        "array32 of 50M empty arrays": b"\xdd" + (50_000_000).to_bytes(4, "big") + b"\x90" * 50_000_000,
        "array header 2^32-1": b"\xdd\xff\xff\xff\xff",
        "map header 2^32-1": b"\xdf\xff\xff\xff\xff",
        "str header 2^32-1": b"\xdb\xff\xff\xff\xff",
        "bin header 2^32-1": b"\xc6\xff\xff\xff\xff",
        "nesting 1025 deep": b"\x91" * 1025 + b"\xc0",
        "nesting 33 deep": b"\x91" * 33 + b"\xc0",
        "mixed key types": msgpack.packb({"a": 1, b"b": 2}, use_bin_type=True),
        "int keys": msgpack.packb({1: 2}),
        "nan": msgpack.packb({"x": float("nan")}),
        "inf in list": msgpack.packb({"x": [1.0, float("inf")]}),
        "-inf nested": msgpack.packb([[{"y": -math.inf}]]),
        "ext type": msgpack.packb(msgpack.ExtType(5, b"abc")),
        "timestamp": b"\xd6\xff\x00\x00\x00\x01",
        "invalid utf-8": b"\xa2\xff\xfe",
        "trailing bytes": b"\xc0\xc0",
        "empty": b"",
        "reserved byte 0xc1": b"\xc1",
    }


@pytest.mark.parametrize("name", list(_bombs()))
def test_bombs_rejected_cheaply(name):
    data = _bombs()[name]
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            unpack_untrusted(data, max_len=64 * MiB)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * MiB, f"{name}: {peak / MiB:.1f} MiB"


def test_oversize_refused_before_decoding():
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        unpack_untrusted(pack([1] * 100), max_len=10)


def test_container_budget_and_depth_are_parameters():
    assert unpack_untrusted(pack([[]] * 10), max_len=MiB, max_containers=11) == [[]] * 10
    with pytest.raises(ProtocolError):
        unpack_untrusted(pack([[]] * 10), max_len=MiB, max_containers=10)
    nested = [[[1]]]
    assert unpack_untrusted(pack(nested), max_len=MiB, max_depth=3) == nested
    with pytest.raises(ProtocolError):
        unpack_untrusted(pack(nested), max_len=MiB, max_depth=2)


def test_pack_refuses_unencodable():
    with pytest.raises(ValueError):
        pack(object())


MSG = {"i": 5, "f": 1.5, "nan": float("nan"), "s": "abc", "b": b"xyz", "l": [1, 2], "t": True}


@pytest.mark.parametrize(
    "call,ok",
    [
        (lambda: get_int(MSG, "i", 0, 10), 5),
        (lambda: get_int(MSG, "i", 6, 10), None),
        (lambda: get_int(MSG, "t", 0, 10), None),
        (lambda: get_int(MSG, "f", 0, 10), None),
        (lambda: get_int(MSG, "missing", 0, 10), None),
        (lambda: get_int([1], "i", 0, 10), None),
        (lambda: get_float(MSG, "f", 0, 2), 1.5),
        (lambda: get_float(MSG, "i", 0, 10), 5.0),
        (lambda: get_float(MSG, "nan", -1e308, 1e308), None),
        (lambda: get_float(MSG, "f", 2, 3), None),
        (lambda: get_float(MSG, "s", 0, 1), None),
        (lambda: get_str(MSG, "s", 3), "abc"),
        (lambda: get_str(MSG, "s", 2), None),
        (lambda: get_str(MSG, "b", 10), None),
        (lambda: get_bytes(MSG, "b", 3, 3), b"xyz"),
        (lambda: get_bytes(MSG, "b", 4, 8), None),
        (lambda: get_bytes(MSG, "s", 0, 8), None),
        (lambda: get_list(MSG, "l", 2), [1, 2]),
        (lambda: get_list(MSG, "l", 1), None),
        (lambda: get_list(MSG, "s", 9), None),
    ],
)
def test_field_checkers(call, ok):
    if ok is None:
        with pytest.raises(ProtocolError):
            call()
    else:
        assert call() == ok
