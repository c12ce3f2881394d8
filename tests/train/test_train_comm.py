"""In-memory Comm and the collectives built on it (the tensor format: tests/train/test_train_codec.py)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from dtfm.train import CommClosed, CommError, CommTimeout, InMemoryHub, all_reduce_small, ring_all_reduce
from dtfm.train.collective import make_buckets


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


@pytest.mark.parametrize("recorded", [CommError("peer 'b' failed: gone"), OSError("connection reset")])
def test_a_failure_raised_to_each_waiter_keeps_none_of_their_frames(recorded):
    """One broken stream fails every handle of it with the error it recorded. Raising that one
    object would hang each waiter's frames on it, and with them what they held (a failed step's
    activations and their graph), until a full collection: each wait raises a new exception."""
    from dtfm.train import EventHandle

    class Held:  # stands for a failed step's tensors
        pass

    handles = [EventHandle(f"send {i}") for i in range(2)]
    for h in handles:
        h.fail(recorded)

    def waiter(h: EventHandle) -> weakref.ref:
        held = Held()
        try:
            h.wait(1)
        except CommError:
            pass
        return weakref.ref(held)

    gc.disable()  # (no collection may hide a reference kept)
    try:
        assert [waiter(h)() for h in handles] == [None, None]
    finally:
        gc.enable()
    with pytest.raises(CommError) as raised:
        handles[0].wait(1)
    assert raised.value is not recorded and type(raised.value) is CommError
    assert "connection reset" in str(raised.value) if isinstance(recorded, OSError) else str(raised.value) == str(recorded)
