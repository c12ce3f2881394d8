"""In-memory Comm, tensor framing, and the collectives built on it."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.net import TENSOR_ITEMSIZE, ProtocolError, pack, tensor_header, unpack_untrusted
from dtfm.train import (TORCH_DTYPES, CommClosed, CommError, CommTimeout, InMemoryHub, all_reduce_small,
                        ring_all_reduce, tensor_from_wire, tensor_to_wire)
from dtfm.train.collective import make_buckets
from dtfm.train.spec import WIRE_DTYPES


def run_all(fns):
    """Run callables in threads; re-raise the first failure."""
    errors, results = [], [None] * len(fns)

    def wrap(i, f):
        try:
            results[i] = f()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


def test_send_recv_fifo_per_tag_and_copy_on_send():
    hub = InMemoryHub()
    a, b = hub.endpoint("a"), hub.endpoint(b"b")
    x = torch.arange(4.0)
    a.isend(b"b", "t", x).wait(1)
    x += 100  # the sender may reuse its buffer at once
    a.isend(b"b", "t", x)
    a.isend(b"b", "u", torch.ones(2))
    assert torch.equal(b.recv("a", "u", 1), torch.ones(2))
    assert torch.equal(b.recv("a", "t", 1), torch.arange(4.0))
    assert torch.equal(b.recv("a", "t", 1), torch.arange(4.0) + 100)
    assert b.open_channels == 0  # drained channels are dropped


def test_recv_times_out_and_abort_wakes_waiters():
    hub = InMemoryHub()
    a = hub.endpoint("a")
    with pytest.raises(CommTimeout):
        a.recv("b", "never", 0.01)
    woke = []

    def waiter():
        try:
            a.recv("b", "never", 30)
        except CommClosed:
            woke.append(True)

    t = threading.Thread(target=waiter)
    t.start()
    hub.abort()
    t.join(10)
    assert woke == [True]


def test_full_queue_applies_back_pressure():
    hub = InMemoryHub(capacity=1)
    a = hub.endpoint("a")
    a.send_timeout_s = 0.01
    a.isend("b", "t", torch.zeros(1))
    with pytest.raises(CommTimeout):
        a.isend("b", "t", torch.zeros(1))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_bytes", [1024, 1 << 20])
def test_ring_all_reduce_sums_and_replicas_agree(n, bucket_bytes):
    hub = InMemoryHub()
    group = [f"p{i}" for i in range(n)]
    gen = torch.Generator().manual_seed(n)
    shapes = [(3, 5), (700,), (1,), (17, 2)]  # 700 floats > one 1 KiB bucket
    inputs = [[torch.randn(s, generator=gen) for s in shapes] for _ in group]
    want = [sum(inp[k] for inp in inputs) for k in range(len(shapes))]
    bufs = [[t.clone() for t in inp] for inp in inputs]
    run_all([lambda i=i: ring_all_reduce(hub.endpoint(group[i]), group, bufs[i], "g", 10, bucket_bytes)
             for i in range(n)])
    for i in range(n):
        for k in range(len(shapes)):
            torch.testing.assert_close(bufs[i][k], want[k])
            assert torch.equal(bufs[i][k], bufs[0][k])  # bit-identical on every member


def test_all_reduce_small_same_bits_everywhere():
    hub = InMemoryHub()
    group = ["x", "y", "z"]
    vals = [torch.tensor([0.1], dtype=torch.float64), torch.tensor([0.2], dtype=torch.float64),
            torch.tensor([0.3], dtype=torch.float64)]
    out = run_all([lambda i=i: all_reduce_small(hub.endpoint(group[i]), group, vals[i], "n", 10) for i in range(3)])
    assert out[0].item() == out[1].item() == out[2].item() == pytest.approx(0.6)


def test_collective_refuses_wrong_shape_from_peer():
    hub = InMemoryHub()
    hub.endpoint("b").isend("a", "n", torch.zeros(2))
    with pytest.raises(CommError, match="peer 'b'"):
        all_reduce_small(hub.endpoint("a"), ["a", "b"], torch.zeros(1), "n", 1)


def test_make_buckets_keeps_order_and_limit():
    ts = [torch.zeros(100), torch.zeros(100), torch.zeros(1000), torch.zeros(10)]
    assert make_buckets(ts, 800) == [[0, 1], [2], [3]]


@pytest.mark.parametrize("name", sorted(TENSOR_ITEMSIZE))
def test_every_wire_dtype_round_trips_through_torch(name):
    """Train accepts exactly the net layer's dtypes (all of which torch has), byte for byte."""
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
    with pytest.raises(ProtocolError, match="spans more"):
        tensor_from_wire(tensor_header("float32", (1 << 30,)), b"", max_bytes=1 << 20)
    with pytest.raises(ProtocolError, match="not allowed"):
        tensor_from_wire({"dtype": "object", "shape": [1]}, b"\0" * 8, max_bytes=64)
    with pytest.raises(ProtocolError, match="spans more"):  # 2**64 elements must not wrap around to 0
        tensor_from_wire(tensor_header("float32", (1 << 32, 1 << 32)), b"", max_bytes=64)
    with pytest.raises(ProtocolError, match="spans more"):  # empty, but torch could not stride it
        tensor_from_wire(tensor_header("uint8", (0, 1 << 40, 1 << 40)), b"", max_bytes=1 << 62)
    with pytest.raises(ProtocolError, match="0 and 1"):
        tensor_from_wire(tensor_header("bool", (2,)), b"\x01\x02", max_bytes=64)


garbage_headers = st.fixed_dictionaries({
    "dtype": st.sampled_from(sorted(TENSOR_ITEMSIZE)) | st.text(max_size=10) | st.integers(),
    "shape": st.lists(st.integers(-5, 1 << 64) | st.booleans() | st.none(), max_size=10) | st.none(),
}) | st.none() | st.lists(st.integers(), max_size=3) | st.text(max_size=10)


@settings(max_examples=300, deadline=None)
@given(garbage_headers, st.binary(max_size=64) | st.none())
def test_garbage_tensor_from_wire_raises_protocol_error_only(header, data):
    try:
        t = tensor_from_wire(header, None if data is None else bytearray(data), max_bytes=64)
    except ProtocolError:
        return
    assert t.numel() * t.element_size() == len(data)
    assert tuple(t.shape) == tuple(header["shape"]) and t.dtype == TORCH_DTYPES[header["dtype"]]


def test_emulated_link_keeps_order_and_completes_handles():
    from dtfm.train import Link

    hub = InMemoryHub(link=lambda src, dst: Link(latency_s=0.001, bandwidth_bytes_per_s=1e9))
    a, b = hub.endpoint("a"), hub.endpoint("b")
    handles = [a.isend("b", "t", torch.full((1000,), float(i))) for i in range(5)]
    for h in handles:
        h.wait(5)
    assert [float(b.recv("a", "t", 5)[0]) for _ in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError):
        Link(latency_s=-1, bandwidth_bytes_per_s=1)


def test_event_handle_completed_from_another_thread():
    from dtfm.train import EventHandle

    h = EventHandle("send 'x' to 'b'")
    with pytest.raises(CommTimeout, match="send 'x'"):
        h.wait(0.001)
    t = threading.Thread(target=h.done)
    t.start()
    t.join()
    h.wait(1)
    bad = EventHandle()
    bad.fail(OSError("connection reset"))
    with pytest.raises(CommError, match="connection reset"):
        bad.wait(1)
