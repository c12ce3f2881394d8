"""The record layer of a connection: sealing, writing, reading and opening records.

`RecordWriter` encrypts plaintext frames (renewing keys when due) and writes them; `RecordReader`
reads records, refuses oversize ones before reading their body, decrypts and turns frames into
events. A payload chunk travels as two records, its CHUNK frame and then its bytes (see
`frames`): the writer seals both straight from the sender's buffer into one reused output
buffer and writes them with one call; the reader receives the bytes' record straight into the
payload's buffer and opens it there. Large payloads are thus never copied in Python: each
byte is read once by the kernel and once by the cipher on each side.

Without worker threads all of it runs in the calling task (the link shape's for the writer,
the connection's reader task): socket reads and writes wait only when they would block. With
`crypto_thread_min_bytes` set, large records are sealed/opened on worker threads (libsodium
releases the GIL), and the writer pipelines over two buffers: it seals record k+1 while a
writer task still sends record k.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import trio

from . import frames
from .errors import ConnectionClosed, ProtocolError
from .session import PREFIX_BYTES, RecvCipher, SendCipher, parse_prefix
from .streamio import StreamReader, StreamWriter


def max_record_bytes(max_control_frame_bytes: int, chunk_bytes: int, tag_bytes: int) -> int:
    return max(max_control_frame_bytes, frames.CHUNK_HEADER_BYTES + chunk_bytes) + tag_bytes


# A record buffer grown past this (a payload chunk, a large control frame) goes back to its first
# size once no record that large has passed for SHRINK_AFTER_S: an idle connection that carried
# one bandwidth probe or one stage transfer keeps 4 KiB, not a megabyte on each side.
LARGE_RECORD_BYTES = 64 * 1024
SHRINK_AFTER_S = 30.0
_FIRST_BYTES = 4096


def _grow(buf: bytearray, n: int, cap: int) -> bytearray:
    return buf if len(buf) >= n else bytearray(max(n, min(2 * len(buf), cap)))


def _sized(buf: bytearray, n: int, cap: int, large_at: float, now: float) -> bytearray:
    """`buf` grown to hold `n` bytes, or back to its first size when it holds a large record's
    room that no large record used for SHRINK_AFTER_S and `n` fits the first size."""
    if n <= _FIRST_BYTES and len(buf) > LARGE_RECORD_BYTES and now - large_at >= SHRINK_AFTER_S:
        return bytearray(_FIRST_BYTES)
    return _grow(buf, n, cap)


async def detach_chunks(chunks: Iterable[frames.Chunk]) -> None:
    """Make queued chunks independent of the sender's buffer: copy the bytes of those not yet
    sealed, and wait for one being sealed on a worker thread (even if cancelled: the thread
    reads the buffer until it is done)."""
    chunks = list(chunks)
    for c in chunks:
        c.detach()
    with trio.CancelScope(shield=True):
        for c in chunks:
            while c.state == frames.Chunk.SEALING:
                await trio.sleep(0.001)


class RecordWriter:
    def __init__(
        self,
        stream: trio.abc.SendStream,
        cipher: SendCipher,
        *,
        max_record: int,
        rekey_after_records: int,
        rekey_interval_s: float,
        send_stall_timeout_s: float,
        thread_min_bytes: int,
        peer: str,
    ) -> None:
        self.cipher = cipher
        self.last_sent = trio.current_time()
        self.last_rekey = trio.current_time()
        self._writer = StreamWriter(stream)
        self._max_out = 2 * (PREFIX_BYTES + cipher.tag_bytes) + frames.CHUNK_HEADER_BYTES + max_record
        self._rekey_after_records = rekey_after_records
        self._rekey_interval_s = rekey_interval_s
        self._stall_s = send_stall_timeout_s
        self._thread_min = thread_min_bytes
        self._peer = peer
        self._outs = [bytearray(_FIRST_BYTES), bytearray(_FIRST_BYTES)]
        self._out_index = 0
        self._large_at = -math.inf  # when the last record over LARGE_RECORD_BYTES was sealed
        self._lock = trio.Lock()
        self._to_writer, self._from_writer = trio.open_memory_channel(0)
        self._running = False

    @property
    def buffer_bytes(self) -> int:
        """Bytes held by the output buffers."""
        return sum(len(b) for b in self._outs)

    async def run(self) -> None:
        """With worker threads, the writer task: sends handed-off records in order while the
        next one is sealed; raises `ConnectionClosed`. Without, `transmit` writes its records
        itself and this returns at once."""
        if not self._thread_min:
            return
        self._running = True
        try:
            async for record in self._from_writer:
                if record is not None:
                    await self._write(record)
        finally:
            self._running = False

    async def transmit(self, frame: bytes | frames.Chunk, *, flush: bool = False) -> None:
        """Encrypt one frame, or a chunk's two records (renewing the key first when due), and
        write it or hand it to the writer task. `flush` waits until it is on the socket."""
        async with self._lock:
            now = trio.current_time()
            cipher = self.cipher
            if cipher.counter >= self._rekey_after_records or now - self.last_rekey >= self._rekey_interval_s:
                await self._hand_off(cipher.seal(frames.encode_rekey()))
                cipher.ratchet()
                self.last_rekey = now
            i = self._out_index
            if self._running:
                self._out_index ^= 1  # the other buffer may still be on its way out
            overhead = PREFIX_BYTES + cipher.tag_bytes
            if isinstance(frame, frames.Chunk):
                header, data = frame.header(), frame.data
                size = 2 * overhead + len(header) + data.nbytes
                out = self._outs[i] = self._out_buffer(i, size, now)
                frame.state = frames.Chunk.SEALING
                try:
                    if self._thread_min and data.nbytes >= self._thread_min:
                        end = await trio.to_thread.run_sync(self._seal_chunk, header, data, out)
                    else:
                        end = self._seal_chunk(header, data, out)
                finally:
                    frame.state = frames.Chunk.SEALED
            else:
                out = self._outs[i] = self._out_buffer(i, overhead + len(frame), now)
                if self._thread_min and len(frame) >= self._thread_min:
                    end = await trio.to_thread.run_sync(cipher.seal_at, frame, out, 0)
                else:
                    end = cipher.seal_at(frame, out, 0)
            await self._hand_off(memoryview(out)[:end])
            if flush:
                await self._hand_off(None)
            self.last_sent = now

    def _out_buffer(self, i: int, size: int, now: float) -> bytearray:
        """Output buffer `i` (free: the record sealed in it two records ago is written) for a
        record of `size` bytes; it shrinks as `_sized` says."""
        if size > LARGE_RECORD_BYTES:
            self._large_at = now
        return _sized(self._outs[i], size, self._max_out, self._large_at, now)

    def _seal_chunk(self, header: bytes, data: memoryview, out: bytearray) -> int:
        return self.cipher.seal_at(data, out, self.cipher.seal_at(header, out, 0))

    async def _hand_off(self, record: bytearray | memoryview | None) -> None:
        # The channel is unbuffered: a hand-off completes once the writer has finished the
        # previous record, so the buffer sealed two records ago is free again.
        if self._running:
            await self._to_writer.send(record)
        elif record is not None:
            await self._write(record)

    async def _write(self, record: bytearray | memoryview) -> None:
        writer = self._writer
        waits = writer.waits
        writer.deadline = trio.current_time() + self._stall_s
        try:
            await writer.send_all(record)
            if writer.waits == waits:  # never blocked: still a checkpoint
                await trio.lowlevel.checkpoint()
        except trio.TooSlowError:
            raise ConnectionClosed(f"send to {self._peer} stalled") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise ConnectionClosed(f"connection to {self._peer} lost: {e}") from None


class RecordReader:
    def __init__(
        self,
        reader: StreamReader,
        cipher: RecvCipher,
        inbound: frames.Inbound,
        *,
        max_record: int,
        idle_timeout_s: float,
        thread_min_bytes: int,
        peer: str,
    ) -> None:
        self.cipher = cipher
        self.last_seen = trio.current_time()
        self._reader = reader
        self._inbound = inbound
        self._max_record = max_record
        self._idle_s = idle_timeout_s
        self._thread_min = thread_min_bytes
        self._peer = peer
        self._buf = bytearray(_FIRST_BYTES)
        self._large_at = -math.inf  # when the last record over LARGE_RECORD_BYTES was read into `_buf`

    @property
    def buffer_bytes(self) -> int:
        """Bytes held by the buffer records other than payload chunks are read into."""
        return len(self._buf)

    async def run(self, on_message: Callable[[frames.Message], None]) -> None:
        """Deliver messages in order until the peer closes; raises `ProtocolError` for bad
        input and `ConnectionClosed` (reason in str) when the connection ends."""
        reader, cipher, inbound = self._reader, self.cipher, self._inbound
        tag = cipher.tag_bytes
        chunk: frames.ChunkData | None = None  # announced by the last record: the next one's bytes
        while True:
            waits = reader.waits
            reader.deadline = trio.current_time() + self._idle_s
            try:
                prefix = bytes(await reader.read_exactly(PREFIX_BYTES))
                n = parse_prefix(prefix, self._max_record, tag)
                if chunk is not None and n != chunk.size + tag:
                    raise ProtocolError(f"chunk record of {n} bytes, announced {chunk.size} + tag")
                if chunk is not None and chunk.into is not None:
                    record = chunk.into[:n]  # in place: the payload's buffer, then room for the tag
                else:
                    now = trio.current_time()
                    if n > LARGE_RECORD_BYTES:
                        self._large_at = now
                    self._buf = _sized(self._buf, n, self._max_record, self._large_at, now)
                    record = memoryview(self._buf)[:n]
                await reader.read_into(record)
            except trio.TooSlowError:
                raise ConnectionClosed(f"nothing received from {self._peer} for {self._idle_s} s") from None
            if self._thread_min and n >= self._thread_min:
                plain = await trio.to_thread.run_sync(cipher.open_in_place, prefix, record)
            else:
                plain = cipher.open_in_place(prefix, record)
            self.last_seen = trio.current_time()
            event: frames.Message | frames.ChunkData | frames.Rekey | frames.Close | None
            if chunk is not None:
                event = inbound.on_chunk_data(chunk)
                chunk = None
            else:
                event = inbound.on_frame(plain)
            if event is not None:
                if isinstance(event, frames.Message):
                    on_message(event)
                elif isinstance(event, frames.ChunkData):
                    chunk = event
                elif isinstance(event, frames.Rekey):
                    cipher.ratchet()
                elif isinstance(event, frames.Close):
                    raise ConnectionClosed(f"closed by peer: {event.reason}")
            if reader.waits == waits:  # everything was buffered: still a checkpoint per record
                await trio.lowlevel.checkpoint()
