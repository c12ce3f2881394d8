"""The record layer of a connection: sealing, writing, reading and opening records.

`RecordWriter` encrypts plaintext frames (renewing keys when due) and writes them; `RecordReader`
reads records, refuses oversize ones before reading their body, decrypts and turns frames into
events. Both pipeline work across two alternating buffers: the writer seals record k+1 while
record k is still being sent, the reader receives record k+1 while record k is processed.
With `crypto_thread_min_bytes` set, large records are sealed/opened on worker threads
(libsodium releases the GIL), so the crypto overlaps the socket I/O.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from . import frames
from .errors import ConnectionClosed, ProtocolError
from .session import PREFIX_BYTES, RecvCipher, SendCipher, parse_prefix
from .streamio import StreamReader


def max_record_bytes(max_control_frame_bytes: int, chunk_bytes: int, tag_bytes: int) -> int:
    return max(max_control_frame_bytes, frames.CHUNK_HEADER_BYTES + chunk_bytes) + tag_bytes


def _grow(buf: bytearray, n: int, cap: int) -> bytearray:
    return buf if len(buf) >= n else bytearray(max(n, min(2 * len(buf), cap)))


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
        self._stream = stream
        self._max_record = max_record
        self._rekey_after_records = rekey_after_records
        self._rekey_interval_s = rekey_interval_s
        self._stall_s = send_stall_timeout_s
        self._thread_min = thread_min_bytes
        self._peer = peer
        self._outs = [bytearray(4096), bytearray(4096)]
        self._out_index = 0
        self._lock = trio.Lock()
        self._to_writer, self._from_writer = trio.open_memory_channel(0)
        self._running = False

    async def run(self) -> None:
        """The writer task: sends handed-off records in order; raises `ConnectionClosed`."""
        self._running = True
        try:
            async for record in self._from_writer:
                if record is not None:
                    await self._write(record)
        finally:
            self._running = False

    async def transmit(self, frame: bytes, *, flush: bool = False) -> None:
        """Encrypt one frame (renewing the key first when due) and hand it to the writer.

        `flush` waits until the record is on the socket.
        """
        async with self._lock:
            now = trio.current_time()
            if self.cipher.counter >= self._rekey_after_records or now - self.last_rekey >= self._rekey_interval_s:
                await self._hand_off(self.cipher.seal(frames.encode_rekey()))
                self.cipher.ratchet()
                self.last_rekey = now
            i = self._out_index
            self._out_index ^= 1
            self._outs[i] = _grow(self._outs[i], PREFIX_BYTES + len(frame) + self.cipher.tag_bytes, PREFIX_BYTES + self._max_record)
            if self._thread_min and len(frame) >= self._thread_min:
                record = await trio.to_thread.run_sync(self.cipher.seal_into, frame, self._outs[i])
            else:
                record = self.cipher.seal_into(frame, self._outs[i])
            await self._hand_off(record)
            if flush:
                await self._hand_off(None)
            self.last_sent = now

    async def _hand_off(self, record: bytearray | memoryview | None) -> None:
        # The channel is unbuffered: a hand-off completes once the writer has finished the
        # previous record, so the buffer sealed two records ago is free again.
        if self._running:
            await self._to_writer.send(record)
        elif record is not None:
            await self._write(record)

    async def _write(self, record: bytearray | memoryview) -> None:
        try:
            with trio.fail_after(self._stall_s):
                await self._stream.send_all(record)
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
        self._scratch = bytearray(4096)

    async def run(self, on_message: Callable[[frames.Message], None]) -> None:
        """Deliver messages in order until the peer closes; raises `ProtocolError` for bad
        input and `ConnectionClosed` (reason in str) when the connection ends."""
        send, recv = trio.open_memory_channel(0)
        error: ProtocolError | ConnectionClosed | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive, send)
            try:
                await self._process(recv, on_message)
            except (ProtocolError, ConnectionClosed) as e:
                error = e  # raised outside the nursery, so callers see it unwrapped
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error

    async def _process(self, recv: trio.MemoryReceiveChannel, on_message) -> None:
        async for item in recv:
            if isinstance(item, BaseException):
                raise item
            prefix, record = item
            if self._thread_min and len(record) >= self._thread_min:
                event = await trio.to_thread.run_sync(self._open_frame, prefix, record)
            else:
                event = self._open_frame(prefix, record)
            self.last_seen = trio.current_time()
            if event is None:
                continue
            if isinstance(event, frames.Message):
                on_message(event)
            elif isinstance(event, frames.Rekey):
                self.cipher.ratchet()
            elif isinstance(event, frames.Close):
                raise ConnectionClosed(f"closed by peer: {event.reason}")

    def _open_frame(self, prefix: bytes, record: memoryview) -> frames.Message | frames.Rekey | frames.Close | None:
        self._scratch = _grow(self._scratch, len(record), self._max_record)
        return self._inbound.on_frame(self.cipher.open_into(prefix, record, self._scratch))

    async def _receive(self, send: trio.MemorySendChannel) -> None:
        """Receive whole records into two alternating buffers (see `RecordWriter._hand_off`)."""
        bufs = [bytearray(4096), bytearray(4096)]
        i = 0
        async with send:
            while True:
                try:
                    with trio.move_on_after(self._idle_s) as scope:
                        prefix = bytes(await self._reader.read_exactly(PREFIX_BYTES))
                        n = parse_prefix(prefix, self._max_record, self.cipher.tag_bytes)
                        bufs[i] = _grow(bufs[i], n, self._max_record)
                        record = memoryview(bufs[i])[:n]
                        await self._reader.read_into(record)
                    if scope.cancelled_caught:
                        raise ConnectionClosed(f"nothing received from {self._peer} for {self._idle_s} s")
                except (ProtocolError, ConnectionClosed) as e:
                    await send.send(e)
                    return
                await send.send((prefix, record))
                i ^= 1
