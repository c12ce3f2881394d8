"""Plaintext frames inside the encrypted records, and message reassembly (sans-IO).

Frame kinds (first byte):

    MSG    kind | msg_type u8 | flags u8 | msg_id u64 | reply_to u64 | payload_len u64 | body
           one message: a msgpack body, and if payload_len > 0 a raw payload that follows in
           CHUNK frames. Requests carry their msg_id; responses name it in reply_to.
    CHUNK  kind | msg_id u64 | length u32 the next `length` bytes of msg_id's payload are the
           whole plaintext of the next record (a data record: payload bytes, no frame kind)
    REKEY  kind                           the sender's last record under its current key
    CLOSE  kind | reason (utf-8)          the sender is closing the connection
    ABORT  kind | msg_id u64              the sender gave up msg_id's payload part-way (a
                                          timeout); the receiver drops what it holds of it

Chunks of different messages may interleave, and MSG frames travel between chunks, so a large
tensor never holds up a small control message; a CHUNK frame and its data record are sealed
and sent together. Keeping the payload bytes alone in their record lets the sender seal them
straight from the caller's buffer and the receiver receive and open them in place, in the
payload's own buffer (`ChunkData`), with no copy on either side.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .budget import PayloadBudget
from .bufpool import BufferPool, alloc_buffer
from .errors import ProtocolError
from .session import TAG_BYTES
from .wire import unpack_untrusted

MSG, CHUNK, REKEY, CLOSE, ABORT = 1, 2, 3, 4, 5

FLAG_REQUEST = 0x01
FLAG_RESPONSE = 0x02
FLAG_ERROR = 0x04
_KNOWN_FLAGS = FLAG_REQUEST | FLAG_RESPONSE | FLAG_ERROR

_MSG = struct.Struct(">BBBQQQ")
_CHUNK = struct.Struct(">BQI")
_ABORT = struct.Struct(">BQ")
MSG_HEADER_BYTES = _MSG.size
CHUNK_HEADER_BYTES = _CHUNK.size
# Room after a payload's last byte, so that a chunk record's tag can be received in place.
PAYLOAD_TAIL_BYTES = TAG_BYTES
# Free payload buffers a connection keeps for reuse (see `bufpool`): enough for two payloads of
# 64 MiB in turn, one being filled while the application still holds the last.
PAYLOAD_POOL_BYTES = 160 << 20
MAX_CLOSE_REASON_BYTES = 256


def encode_msg(msg_type: int, flags: int, msg_id: int, reply_to: int, body: bytes, payload_len: int) -> bytes:
    return _MSG.pack(MSG, msg_type, flags, msg_id, reply_to, payload_len) + body


def encode_chunk(msg_id: int, n: int) -> bytes:
    """The CHUNK frame announcing that the next record holds `n` payload bytes of msg_id."""
    return _CHUNK.pack(CHUNK, msg_id, n)


class Chunk:
    """An outgoing chunk for the link shape: its CHUNK frame and its bytes, sealed as two records
    straight from the sender's buffer (`data`). Looks like a frame to shapes (`len()` counts
    header and bytes, `[0]` is the kind). The record writer moves `state` from QUEUED through
    SEALING to SEALED; `detach()` copies the bytes of a chunk still QUEUED, so that the sender
    may reuse its buffer."""

    QUEUED, SEALING, SEALED = 0, 1, 2
    __slots__ = ("data", "msg_id", "state")

    def __init__(self, msg_id: int, data: memoryview) -> None:
        self.msg_id = msg_id
        self.data = data
        self.state = Chunk.QUEUED

    def header(self) -> bytes:
        return _CHUNK.pack(CHUNK, self.msg_id, self.data.nbytes)

    def detach(self) -> None:
        if self.state == Chunk.QUEUED:
            self.data = memoryview(bytes(self.data))

    def __len__(self) -> int:
        return CHUNK_HEADER_BYTES + self.data.nbytes

    def __getitem__(self, i: int) -> int:
        return CHUNK if i == 0 else (self.header() + bytes(self.data))[i]


# What a connection hands its link shape: a plaintext frame, or a chunk sealed from its sender's
# buffer.
OutFrame = bytes | Chunk


def encode_rekey() -> bytes:
    return bytes([REKEY])


def encode_close(reason: str) -> bytes:
    return bytes([CLOSE]) + reason.encode("utf-8", "replace")[:MAX_CLOSE_REASON_BYTES]


def encode_abort(msg_id: int) -> bytes:
    return _ABORT.pack(ABORT, msg_id)


@dataclass(frozen=True)
class Message:
    msg_type: int
    flags: int
    msg_id: int
    reply_to: int
    body: object
    payload: memoryview | None
    # Non-empty when the payload was refused rather than received (the transport-wide payload
    # budget was full): says why; `payload` is then None.
    refused: str = ""


def alloc_payload(n: int) -> memoryview:
    """A writable byte buffer of `n` bytes without zero-filling it up front (see `bufpool`)."""
    return alloc_buffer(n)


@dataclass(frozen=True)
class ChunkData:
    """The next record holds the next `size` bytes of message `msg_id`'s payload. It is received
    into `into` (the payload's buffer at that place, `size` bytes and then room for the record's
    tag) and opened there; then `Inbound.on_chunk_data` takes it. `into` is None for a refused
    payload: the record is opened elsewhere and dropped."""

    msg_id: int
    size: int
    into: memoryview | None


@dataclass(frozen=True)
class Rekey:
    pass


@dataclass(frozen=True)
class Close:
    reason: str


@dataclass
class _Partial:
    header: Message
    expected: int
    buf: memoryview | None = None
    filled: int = 0


class Inbound:
    """Turns decrypted frames into events, bounding memory held by incomplete payloads."""

    def __init__(
        self,
        *,
        max_control_frame_bytes: int,
        max_payload_bytes: int,
        max_inflight_payload_bytes: int,
        max_inflight_payloads: int,
        budget: PayloadBudget | None = None,
    ) -> None:
        self.max_control_frame_bytes = max_control_frame_bytes
        self.max_payload_bytes = max_payload_bytes
        self.max_inflight_payload_bytes = max_inflight_payload_bytes
        self.max_inflight_payloads = max_inflight_payloads
        self._partial: dict[int, _Partial] = {}
        self.inflight_bytes = 0
        # Shared with the transport's other connections; None: no transport-wide limit.
        self._budget = budget
        # Payloads refused for the budget: message id -> bytes still to come, read and dropped.
        self._refused: dict[int, int] = {}
        self._buffers = BufferPool(PAYLOAD_POOL_BYTES)

    def on_frame(self, frame: memoryview | bytes) -> Message | ChunkData | Rekey | Close | None:
        """The event completed by `frame`: None for a payload's announcement or an abort,
        `ChunkData` for a CHUNK frame (the next record is that chunk's bytes)."""
        if len(frame) == 0:
            raise ProtocolError("empty frame")
        kind = frame[0]
        if kind == CHUNK:
            return self._on_chunk(frame)
        if kind == MSG:
            return self._on_msg(frame)
        if kind == REKEY:
            if len(frame) != 1:
                raise ProtocolError("malformed rekey frame")
            return Rekey()
        if kind == CLOSE:
            reason = bytes(frame[1 : 1 + MAX_CLOSE_REASON_BYTES]).decode("utf-8", "replace")
            return Close("".join(c if c.isprintable() else "?" for c in reason))
        if kind == ABORT:
            self._on_abort(frame)
            return None
        raise ProtocolError(f"unknown frame kind {kind}")

    def close(self) -> None:
        """The connection is gone: forget incomplete payloads and return their budget."""
        if self._budget is not None:
            self._budget.release(self.inflight_bytes)
        self._partial.clear()
        self._refused.clear()
        self.inflight_bytes = 0

    def _on_abort(self, frame: memoryview | bytes) -> None:
        if len(frame) != _ABORT.size:
            raise ProtocolError("malformed abort frame")
        _, msg_id = _ABORT.unpack_from(frame, 0)
        p = self._partial.pop(msg_id, None)
        if p is not None:
            self._forget(p.expected)
        elif self._refused.pop(msg_id, None) is None:
            raise ProtocolError(f"abort for unknown message id {msg_id}")
        return None

    def _forget(self, n: int) -> None:
        self.inflight_bytes -= n
        if self._budget is not None:
            self._budget.release(n)

    def _drop_refused_chunk(self, msg_id: int, n: int) -> None:
        left = self._refused.get(msg_id)
        if left is None:
            raise ProtocolError(f"chunk for unknown message id {msg_id}")
        if n > left:
            raise ProtocolError(f"payload of message {msg_id} overruns its announced length")
        if n == left:
            del self._refused[msg_id]
        else:
            self._refused[msg_id] = left - n

    def _on_msg(self, frame: memoryview | bytes) -> Message | None:
        if len(frame) > self.max_control_frame_bytes:
            raise ProtocolError(f"message frame of {len(frame)} bytes exceeds {self.max_control_frame_bytes}")
        if len(frame) < MSG_HEADER_BYTES:
            raise ProtocolError("truncated message header")
        _, msg_type, flags, msg_id, reply_to, payload_len = _MSG.unpack_from(frame, 0)
        if flags & ~_KNOWN_FLAGS or (flags & FLAG_REQUEST and flags & FLAG_RESPONSE):
            raise ProtocolError(f"bad message flags {flags:#x}")
        body = unpack_untrusted(memoryview(frame)[MSG_HEADER_BYTES:], max_len=self.max_control_frame_bytes)
        if payload_len == 0:
            return Message(msg_type, flags, msg_id, reply_to, body, None)
        if payload_len > self.max_payload_bytes:
            raise ProtocolError(f"payload of {payload_len} bytes exceeds {self.max_payload_bytes}")
        if msg_id in self._partial or msg_id in self._refused:
            raise ProtocolError(f"message id {msg_id} reused while its payload is incomplete")
        if len(self._partial) + len(self._refused) >= self.max_inflight_payloads:
            raise ProtocolError(f"more than {self.max_inflight_payloads} payloads in flight")
        if self.inflight_bytes + payload_len > self.max_inflight_payload_bytes:
            raise ProtocolError(f"more than {self.max_inflight_payload_bytes} payload bytes in flight")
        if self._budget is not None and not self._budget.reserve(payload_len):
            # Not the peer's fault: other connections hold the memory. The payload's chunks are
            # read and dropped; the message is delivered without it, saying why.
            self._refused[msg_id] = payload_len
            b = self._budget
            reason = (f"payload of {payload_len} bytes refused: the receiver's payload budget "
                      f"({b.used_bytes} of {b.limit_bytes} bytes in use) is full")
            return Message(msg_type, flags, msg_id, reply_to, body, None, reason)
        self.inflight_bytes += payload_len
        header = Message(msg_type, flags, msg_id, reply_to, body, None)
        # The buffer is allocated when the first chunk arrives, not on the announcement alone.
        self._partial[msg_id] = _Partial(header, payload_len)
        return None

    def _on_chunk(self, frame: memoryview | bytes) -> ChunkData:
        if len(frame) < 9:
            raise ProtocolError("truncated chunk frame")
        msg_id = int.from_bytes(frame[1:9], "big")
        p = self._partial.get(msg_id)
        if p is None and msg_id not in self._refused:
            raise ProtocolError(f"chunk for unknown message id {msg_id}")
        if len(frame) != CHUNK_HEADER_BYTES:
            raise ProtocolError("malformed chunk frame")
        _, _, n = _CHUNK.unpack_from(frame, 0)
        if n == 0:
            raise ProtocolError("empty chunk")
        if p is None:
            if n > self._refused[msg_id]:
                raise ProtocolError(f"payload of message {msg_id} overruns its announced length")
            return ChunkData(msg_id, n, None)
        if p.filled + n > p.expected:
            raise ProtocolError(f"payload of message {msg_id} overruns its announced length")
        if p.buf is None:
            p.buf = self._buffers.take(p.expected + PAYLOAD_TAIL_BYTES)
        return ChunkData(msg_id, n, p.buf[p.filled : p.filled + n + PAYLOAD_TAIL_BYTES])

    def on_chunk_data(self, chunk: ChunkData) -> Message | None:
        """The record announced by `chunk` was opened (in place): the payload's next bytes are
        in. Returns the message once its payload is complete."""
        if chunk.into is None:
            self._drop_refused_chunk(chunk.msg_id, chunk.size)
            return None
        p = self._partial.get(chunk.msg_id)
        if p is None:
            raise ProtocolError(f"chunk for unknown message id {chunk.msg_id}")
        if p.buf is None:
            raise ProtocolError(f"chunk data for message {chunk.msg_id} before its chunk frame")
        p.filled += chunk.size
        if p.filled < p.expected:
            return None
        del self._partial[chunk.msg_id]
        self._forget(p.expected)
        h = p.header
        return Message(h.msg_type, h.flags, h.msg_id, h.reply_to, h.body, p.buf[: p.expected])
