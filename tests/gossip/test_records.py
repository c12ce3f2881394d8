"""The payload path of the record layer: in-place opening, chunks as a CHUNK frame plus a data
record, reuse of receive buffers, and the sender's buffer after `send()` returns."""

import gc
import os

import pytest
import trio
import trio.testing

from dtfm.net import frames
from dtfm.net.bufpool import BufferPool
from dtfm.net.errors import ConnectionClosed, ProtocolError
from dtfm.net.records import RecordReader, RecordWriter, detach_chunks
from dtfm.net.session import PREFIX_BYTES, SUITES, RecvCipher, SendCipher
from dtfm.net.streamio import StreamReader

KEY = bytes(range(32))
MiB = 1 << 20


@pytest.mark.parametrize("suite", sorted(SUITES))
@pytest.mark.parametrize("n", [0, 1, 15, 16, 31, 32, 33, 255, 4097, MiB + 7])
def test_open_in_place_matches_sealed_plaintext(suite, n):
    plain = os.urandom(n)
    out = bytearray(2 * (n + 64) + 64)
    end = SendCipher(KEY, suite).seal_at(b"header", out, 0)
    end2 = SendCipher(KEY, suite).seal_at(plain, out, end)  # a second, independent stream
    recv = RecvCipher(KEY, suite)
    record = memoryview(out)[end + PREFIX_BYTES : end2]
    assert bytes(recv.open_in_place(bytes(out[end : end + PREFIX_BYTES]), record)) == plain
    tampered = bytearray(out[end:end2])
    tampered[-1] ^= 1
    with pytest.raises(ProtocolError, match="failed authentication"):
        RecvCipher(KEY, suite).open_in_place(bytes(tampered[:PREFIX_BYTES]), memoryview(tampered)[PREFIX_BYTES:])


def inbound(**kw):
    return frames.Inbound(
        max_control_frame_bytes=MiB, max_payload_bytes=64 * MiB, max_inflight_payload_bytes=128 * MiB,
        max_inflight_payloads=4, **kw,
    )


def test_chunk_frames_point_into_the_payload_buffer():
    ib = inbound()
    assert ib.on_frame(frames.encode_msg(70, 0, 5, 0, b"\xc0", 10)) is None
    first = ib.on_frame(frames.encode_chunk(5, 6))
    assert isinstance(first, frames.ChunkData) and first.size == 6
    assert len(first.into) >= 6 + frames.PAYLOAD_TAIL_BYTES
    first.into[:6] = b"abcdef"
    assert ib.on_chunk_data(first) is None
    second = ib.on_frame(frames.encode_chunk(5, 4))
    second.into[:4] = b"ghij"
    msg = ib.on_chunk_data(second)
    assert bytes(msg.payload) == b"abcdefghij" and ib.inflight_bytes == 0
    with pytest.raises(ProtocolError, match="unknown message id"):
        ib.on_frame(frames.encode_chunk(5, 1))


@pytest.mark.parametrize(
    "frame, reason",
    [
        (frames.encode_chunk(5, 11), "overruns"),
        (frames.encode_chunk(5, 0), "empty chunk"),
        (frames.encode_chunk(5, 4) + b"x", "malformed chunk"),
        (frames.encode_chunk(5, 4)[:8], "truncated chunk"),
    ],
)
def test_bad_chunk_frames(frame, reason):
    ib = inbound()
    ib.on_frame(frames.encode_msg(70, 0, 5, 0, b"\xc0", 10))
    with pytest.raises(ProtocolError, match=reason):
        ib.on_frame(frame)


def test_buffer_pool_recycles_a_buffer_once_every_view_is_gone():
    pool = BufferPool(max_bytes=8 * MiB, min_buffer_bytes=MiB)
    pool.take(2 * MiB)  # (a size taken before: a stream of payloads, whose buffers are kept)
    gc.collect()
    a = pool.take(2 * MiB)
    derived = a[10:20]  # any view keeps the memory out of the pool
    del a
    gc.collect()
    assert pool.free_bytes == 0
    del derived
    gc.collect()
    assert pool.free_bytes == 2 * MiB
    b = pool.take(2 * MiB)
    assert pool.free_bytes == 0 and b.nbytes == 2 * MiB
    small = pool.take(100)  # below min_buffer_bytes: not pooled
    del b, small
    gc.collect()
    assert pool.free_bytes == 2 * MiB
    big = [pool.take(5 * MiB) for _ in range(2)]  # more than max_bytes of free buffers: released
    del big
    gc.collect()
    assert pool.free_bytes <= 8 * MiB


def test_a_lone_payloads_buffer_is_not_kept():
    """A payload whose size was not taken within recur_s before (a bandwidth probe every few
    minutes, a stage fetched once) gives its buffer back to the system, so an idle connection
    holds no pooled memory; a size that recurs within it is a stream, and kept."""
    now = [0.0]
    pool = BufferPool(max_bytes=64 * MiB, min_buffer_bytes=MiB, recur_s=30.0, clock=lambda: now[0])
    for t in (0.0, 600.0, 1200.0):  # a probe every 10 minutes
        now[0] = t
        probe = pool.take(MiB)
        del probe
        gc.collect()
        assert pool.free_bytes == 0
    for t in (1201.0, 1202.0, 1203.0):  # a step's payload every second
        now[0] = t
        step = pool.take(MiB)
        del step
        gc.collect()
    assert pool.free_bytes == MiB


def test_buffer_pool_keeps_two_of_a_size_after_a_burst():
    """A burst of same-size payloads (a ring all-reduce's buckets, a transfer's chunks) leaves
    two buffers of that size in the pool, not every one of them."""
    pool = BufferPool(max_bytes=64 * MiB, min_buffer_bytes=MiB)
    burst = [pool.take(2 * MiB) for _ in range(10)]
    del burst
    gc.collect()
    assert pool.free_bytes == 4 * MiB
    other = [pool.take(3 * MiB) for _ in range(3)]  # another size has its own two
    del other
    gc.collect()
    assert pool.free_bytes == 4 * MiB + 6 * MiB
    again = [pool.take(2 * MiB) for _ in range(2)]  # the kept ones are handed out again
    assert pool.free_bytes == 6 * MiB and all(b.nbytes == 2 * MiB for b in again)


async def test_queued_chunks_are_detached_from_the_senders_buffer():
    buf = bytearray(b"0123456789")
    sealed = frames.Chunk(1, memoryview(buf)[:5])
    sealed.state = frames.Chunk.SEALED
    queued = frames.Chunk(1, memoryview(buf)[5:])
    await detach_chunks([sealed, queued])
    buf[:] = b"x" * 10
    assert bytes(queued.data) == b"56789"
    assert len(queued) == frames.CHUNK_HEADER_BYTES + 5 and queued[0] == frames.CHUNK


def pair_over_memory_streams(suite="chacha20poly1305", **writer_kw):
    left, right = trio.testing.memory_stream_pair()
    writer = RecordWriter(
        left, SendCipher(KEY, suite), max_record=MiB + 64, rekey_after_records=writer_kw.get("rekey", 2**32),
        rekey_interval_s=1e9, send_stall_timeout_s=5, thread_min_bytes=0, peer="a",
    )
    reader = RecordReader(
        StreamReader(right), RecvCipher(KEY, suite), inbound(), max_record=MiB + 64, idle_timeout_s=5,
        thread_min_bytes=0, peer="b",
    )
    return writer, reader


async def test_chunks_cross_the_record_layer_across_key_renewals():
    writer, reader = pair_over_memory_streams(rekey=3)
    payload = os.urandom(3 * MiB + 5)
    got = []

    async def send():
        await writer.transmit(frames.encode_msg(70, 0, 9, 0, b"\xc0", len(payload)))
        view = memoryview(payload)
        for off in range(0, len(payload), MiB):
            await writer.transmit(frames.Chunk(9, view[off : off + MiB]))
        await writer.transmit(frames.encode_close("done"))

    async with trio.open_nursery() as n:
        n.start_soon(send)
        with pytest.raises(ConnectionClosed, match="done"):
            await reader.run(got.append)
    assert len(got) == 1 and bytes(got[0].payload) == payload


async def test_a_data_record_of_another_length_than_announced_is_refused():
    writer, reader = pair_over_memory_streams()

    async def send():
        await writer.transmit(frames.encode_msg(70, 0, 9, 0, b"\xc0", 100))
        await writer.transmit(frames.encode_chunk(9, 50))
        await writer.transmit(bytes(40))

    async with trio.open_nursery() as n:
        n.start_soon(send)
        with pytest.raises(ProtocolError, match="announced 50"):
            await reader.run(lambda m: None)


async def test_a_payload_buffer_may_be_reused_once_send_returns():
    from dtfm.net import Transport, TransportConfig
    from dtfm.net.identity import Identity

    cfg = TransportConfig.test()
    a, b = Transport(Identity.generate(), KEY, cfg), Transport(Identity.generate(), KEY, cfg)
    got = []
    done = trio.Event()

    async def keep(conn, msg_type, body, payload):
        got.append(bytes(payload))
        if len(got) == 3:
            done.set()

    a.handle(70, keep)
    async with trio.open_nursery() as n:
        host, port = await n.start(a.serve, "127.0.0.1", 0)
        await n.start(b.run)
        conn = await b.connect(host, port)
        buf = bytearray(5 * cfg.chunk_bytes + 3)
        for i in range(3):
            buf[:] = bytes([i + 1]) * len(buf)
            await conn.send(70, i, payload=buf)  # refilled at once: queued chunks must not see it
        with trio.fail_after(10):
            await done.wait()
        assert got == [bytes([i + 1]) * len(buf) for i in range(3)]
        n.cancel_scope.cancel()


@pytest.mark.skipif(not hasattr(__import__("socket"), "SO_RCVLOWAT"), reason="no SO_RCVLOWAT here")
async def test_a_large_read_takes_its_bytes_as_they_come_and_leaves_the_low_water_mark_alone():
    """A reader that raised the socket's low-water mark for a large read was not always woken
    once the bytes were in (a connection's direction then delivered nothing until the idle
    timeout, its sender writing on): the mark stays the kernel's, 1 byte."""
    import socket

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as n:
        writer = await trio.open_tcp_stream("127.0.0.1", port)
        reader_stream = await listeners[0].accept()
        reader = StreamReader(reader_stream)
        data = os.urandom(MiB)

        marks = []

        async def dribble():
            for off in range(0, MiB, 64 << 10):  # 16 pieces, each alone on the wire for a moment
                await writer.send_all(data[off : off + (64 << 10)])
                await trio.sleep(0.005)
                marks.append(reader_stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))
            await writer.send_all(b"tail")

        n.start_soon(dribble)
        dest = memoryview(bytearray(MiB))
        with trio.fail_after(10):
            await reader.read_into(dest)
        assert bytes(dest) == data
        assert reader.waits >= 2  # it waited, piece by piece, the mark at 1 byte all along
        assert marks and set(marks) == {1}
        with trio.fail_after(5):  # four bytes are four bytes: no wait for a megabyte
            assert bytes(await reader.read_exactly(4)) == b"tail"
        await writer.aclose()
        await reader_stream.aclose()
        for listener in listeners:
            await listener.aclose()
        n.cancel_scope.cancel()
