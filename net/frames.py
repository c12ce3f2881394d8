"""Plaintext frames inside the encrypted records, and message reassembly (sans-IO).

Frame kinds (first byte):

    MSG    kind | msg_type u8 | flags u8 | msg_id u64 | reply_to u64 | payload_len u64 | body
           one message: a msgpack body, and if payload_len > 0 a raw payload that follows in
           CHUNK frames. Requests carry their msg_id; responses name it in reply_to.
    CHUNK  kind | msg_id u64 | bytes      the next piece of msg_id's payload
    REKEY  kind                           the sender's last record under its current key
    CLOSE  kind | reason (utf-8)          the sender is closing the connection
    ABORT  kind | msg_id u64              the sender gave up msg_id's payload part-way (a
                                          timeout); the receiver drops what it holds of it

Chunks of different messages may interleave, and MSG frames travel between chunks, so a large
tensor never holds up a small control message.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from .budget import PayloadBudget
from .errors import ProtocolError
from .wire import unpack_untrusted

MSG, CHUNK, REKEY, CLOSE, ABORT = 1, 2, 3, 4, 5

FLAG_REQUEST = 0x01
FLAG_RESPONSE = 0x02
FLAG_ERROR = 0x04
_KNOWN_FLAGS = FLAG_REQUEST | FLAG_RESPONSE | FLAG_ERROR

_MSG = struct.Struct(">BBBQQQ")
_CHUNK = struct.Struct(">BQ")
_ABORT = struct.Struct(">BQ")
MSG_HEADER_BYTES = _MSG.size
CHUNK_HEADER_BYTES = _CHUNK.size
MAX_CLOSE_REASON_BYTES = 256


def encode_msg(msg_type: int, flags: int, msg_id: int, reply_to: int, body: bytes, payload_len: int) -> bytes:
    return _MSG.pack(MSG, msg_type, flags, msg_id, reply_to, payload_len) + body


def encode_chunk(msg_id: int, data: bytes | memoryview) -> bytes:
    return _CHUNK.pack(CHUNK, msg_id) + data


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
    """A writable byte buffer of `n` bytes without zero-filling it up front.

    `bytearray(n)` writes every byte before use, which for a large payload both costs as much
    as decrypting it and blocks the event loop; numpy's allocation leaves pages untouched until
    chunks land in them.
    """
    return memoryview(np.empty(n, dtype=np.uint8)).cast("B")


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

    def on_frame(self, frame: memoryview | bytes) -> Message | Rekey | Close | None:
        """The event completed by `frame`, or None when it was a chunk of an unfinished payload."""
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
            return self._on_abort(frame)
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

    def _on_chunk(self, frame: memoryview | bytes) -> Message | None:
        if len(frame) <= CHUNK_HEADER_BYTES:
            raise ProtocolError("empty or truncated chunk")
        _, msg_id = _CHUNK.unpack_from(frame, 0)
        p = self._partial.get(msg_id)
        if p is None:
            self._drop_refused_chunk(msg_id, len(frame) - CHUNK_HEADER_BYTES)
            return None
        n = len(frame) - CHUNK_HEADER_BYTES
        if p.filled + n > p.expected:
            raise ProtocolError(f"payload of message {msg_id} overruns its announced length")
        if p.buf is None:
            p.buf = alloc_payload(p.expected)
        p.buf[p.filled : p.filled + n] = memoryview(frame)[CHUNK_HEADER_BYTES:]
        p.filled += n
        if p.filled < p.expected:
            return None
        del self._partial[msg_id]
        self._forget(p.expected)
        h = p.header
        return Message(h.msg_type, h.flags, h.msg_id, h.reply_to, h.body, p.buf)
