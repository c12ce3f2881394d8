"""Record protection after the handshake: ChaCha20-Poly1305 with counter nonces.

Each direction has its own key. A record on the wire is

    u32 big-endian length L | ciphertext (L bytes, 16-byte tag included)

with the length prefix as associated data. Nonces are never sent: both sides count records,
so a replayed, reordered, dropped or altered record fails authentication and the connection is
closed. Keys are renewed by ratcheting (`key' = BLAKE2b(key)`), announced in-band by the
sender's last record under the old key, before the counter could wrap and on a timer; the old
key is forgotten.

libsodium is called through pynacl's cffi module so that encryption and decryption work on
caller-owned buffers without extra copies of megabyte-sized frames.
"""

from __future__ import annotations

import hashlib
import struct

from nacl._sodium import ffi, lib

from .errors import ProtocolError

KEY_BYTES = 32
TAG_BYTES = 16
PREFIX_BYTES = 4
_PREFIX = struct.Struct(">I")
_NONCE = struct.Struct("<4xQ")
MAX_COUNTER = 2**64 - 1


def ratchet(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=KEY_BYTES, person=b"dtfm-rekey").digest()


class _Direction:
    __slots__ = ("_key", "counter", "_nonce", "_len")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError("session keys are 32 bytes")
        self._key = bytes(key)
        self.counter = 0
        self._nonce = bytearray(12)
        self._len = ffi.new("unsigned long long *")

    def _next_nonce(self) -> bytearray:
        if self.counter >= MAX_COUNTER:
            raise ProtocolError("record counter exhausted without key renewal")
        _NONCE.pack_into(self._nonce, 0, self.counter)
        self.counter += 1
        return self._nonce

    def ratchet(self) -> None:
        self._key = ratchet(self._key)
        self.counter = 0


class SendCipher(_Direction):
    """Seals plaintext frames into wire records."""

    def seal(self, frame: bytes | bytearray | memoryview) -> bytearray:
        """`frame` -> length prefix + ciphertext, in one new buffer ready for the socket."""
        out = bytearray(PREFIX_BYTES + len(frame) + TAG_BYTES)
        self.seal_into(frame, out)
        return out

    def seal_into(self, frame: bytes | bytearray | memoryview, out: bytearray) -> memoryview:
        """Like `seal`, writing into the caller's reusable buffer; returns the record's view."""
        n = len(frame)
        size = PREFIX_BYTES + n + TAG_BYTES
        if len(out) < size:
            raise ValueError("output buffer too small")
        _PREFIX.pack_into(out, 0, n + TAG_BYTES)
        nonce = self._next_nonce()
        cbuf = ffi.from_buffer(out)
        rc = lib.crypto_aead_chacha20poly1305_ietf_encrypt(
            ffi.cast("unsigned char *", cbuf) + PREFIX_BYTES,
            self._len,
            ffi.from_buffer(frame),
            n,
            bytes(out[:PREFIX_BYTES]),
            PREFIX_BYTES,
            ffi.NULL,
            bytes(nonce),
            self._key,
        )
        if rc != 0:
            raise RuntimeError("libsodium encryption failed")
        return memoryview(out)[:size]


class RecvCipher(_Direction):
    """Opens wire records; any failure is a `ProtocolError`."""

    def open_into(self, prefix: bytes, ciphertext: memoryview, out: bytearray) -> memoryview:
        """Decrypt `ciphertext` (the record body after `prefix`) into `out`; returns the plaintext view."""
        n = len(ciphertext)
        if n < TAG_BYTES:
            raise ProtocolError("record shorter than its tag")
        m = n - TAG_BYTES
        if len(out) < m:
            raise ValueError("output buffer too small")
        nonce = self._next_nonce()
        rc = lib.crypto_aead_chacha20poly1305_ietf_decrypt(
            ffi.from_buffer(out),
            self._len,
            ffi.NULL,
            ffi.from_buffer(ciphertext),
            n,
            prefix,
            PREFIX_BYTES,
            bytes(nonce),
            self._key,
        )
        if rc != 0:
            raise ProtocolError("record failed authentication (tampered, replayed or reordered)")
        return memoryview(out)[:m]

    def open(self, record: bytes) -> bytes:
        """Decrypt one whole record (prefix included); for tests and small frames."""
        if len(record) < PREFIX_BYTES:
            raise ProtocolError("truncated record")
        (n,) = _PREFIX.unpack_from(record, 0)
        if n != len(record) - PREFIX_BYTES:
            raise ProtocolError("record length does not match its prefix")
        out = bytearray(max(0, n - TAG_BYTES))
        return bytes(self.open_into(record[:PREFIX_BYTES], memoryview(record)[PREFIX_BYTES:], out))


def parse_prefix(prefix: bytes | memoryview, max_record_bytes: int) -> int:
    """Length of the record body announced by a 4-byte prefix, refused if over the limit."""
    (n,) = _PREFIX.unpack_from(prefix, 0)
    if n > max_record_bytes:
        raise ProtocolError(f"record of {n} bytes exceeds the limit of {max_record_bytes}")
    if n < TAG_BYTES:
        raise ProtocolError("record shorter than its tag")
    return n


def encode_prefix(n: int) -> bytes:
    return _PREFIX.pack(n)
