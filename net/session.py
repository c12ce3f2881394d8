"""Record protection after the handshake: an AEAD with counter nonces, one key per direction.

A record on the wire is

    u32 big-endian length L | ciphertext (L bytes, tag included)

with the length prefix as associated data. Nonces are never sent: both sides count records,
so a replayed, reordered, dropped or altered record fails authentication and the connection is
closed. Keys are renewed by ratcheting (`key' = BLAKE2b(key)`), announced in-band by the
sender's last record under the old key, before the counter could wrap and on a timer; the old
key is forgotten.

Two suites, chosen in the handshake: AEGIS-256 where both peers have hardware AES (several
times faster than the alternative), else ChaCha20-Poly1305 (IETF). libsodium is called through
pynacl's cffi module so that megabyte-sized frames are sealed and opened in caller-owned
buffers without extra copies.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass

import nacl.bindings  # noqa: F401  (runs sodium_init: CPU feature detection for the fast paths)
from nacl._sodium import ffi, lib

from .errors import ProtocolError

KEY_BYTES = 32
PREFIX_BYTES = 4
_PREFIX = struct.Struct(">I")
MAX_COUNTER = 2**64 - 1


@dataclass(frozen=True)
class Suite:
    name: str
    tag_bytes: int
    nonce_bytes: int
    encrypt: Callable[..., int]  # libsodium's crypto_aead_*_encrypt through cffi
    decrypt: Callable[..., int]


CHACHA20_POLY1305 = "chacha20poly1305"
AEGIS256 = "aegis256"

SUITES: dict[str, Suite] = {
    CHACHA20_POLY1305: Suite(
        CHACHA20_POLY1305,
        lib.crypto_aead_chacha20poly1305_ietf_abytes(),
        lib.crypto_aead_chacha20poly1305_ietf_npubbytes(),
        lib.crypto_aead_chacha20poly1305_ietf_encrypt,
        lib.crypto_aead_chacha20poly1305_ietf_decrypt,
    ),
}
if hasattr(lib, "crypto_aead_aegis256_encrypt"):  # libsodium >= 1.0.19 (pynacl >= 1.6)
    SUITES[AEGIS256] = Suite(
        AEGIS256,
        lib.crypto_aead_aegis256_abytes(),
        lib.crypto_aead_aegis256_npubbytes(),
        lib.crypto_aead_aegis256_encrypt,
        lib.crypto_aead_aegis256_decrypt,
    )
TAG_BYTES = 32  # for size limits: no suite's tag is longer (AEGIS-256 32, ChaCha20-Poly1305 16)


def local_suites() -> list[str]:
    """Suites this machine runs fast, in order of preference (AEGIS needs hardware AES)."""
    if AEGIS256 in SUITES and lib.crypto_aead_aes256gcm_is_available() == 1:
        return [AEGIS256, CHACHA20_POLY1305]
    return [CHACHA20_POLY1305]


def choose_suite(initiator: list[str], responder: list[str]) -> str:
    """The suite both sides use: AEGIS-256 when both offer it, else ChaCha20-Poly1305."""
    if AEGIS256 in initiator and AEGIS256 in responder:
        return AEGIS256
    if CHACHA20_POLY1305 in initiator and CHACHA20_POLY1305 in responder:
        return CHACHA20_POLY1305
    raise ProtocolError("no common cipher suite")


def ratchet(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=KEY_BYTES, person=b"dtfm-rekey").digest()


class _Direction:
    __slots__ = ("_key", "_len", "_nonce", "counter", "suite", "tag_bytes")

    def __init__(self, key: bytes, suite: str = CHACHA20_POLY1305) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError("session keys are 32 bytes")
        self.suite = SUITES[suite]
        self.tag_bytes = self.suite.tag_bytes
        self._key = bytes(key)
        self.counter = 0
        self._nonce = bytearray(self.suite.nonce_bytes)
        self._len = ffi.new("unsigned long long *")

    def _next_nonce(self) -> bytes:
        if self.counter >= MAX_COUNTER:
            raise ProtocolError("record counter exhausted without key renewal")
        struct.pack_into("<Q", self._nonce, 0, self.counter)
        self.counter += 1
        return bytes(self._nonce)

    def ratchet(self) -> None:
        self._key = ratchet(self._key)
        self.counter = 0


class SendCipher(_Direction):
    """Seals plaintext frames into wire records."""

    def seal(self, frame: bytes | bytearray | memoryview) -> bytearray:
        """`frame` -> length prefix + ciphertext, in one new buffer ready for the socket."""
        out = bytearray(PREFIX_BYTES + len(frame) + self.tag_bytes)
        self.seal_into(frame, out)
        return out

    def seal_into(self, frame: bytes | bytearray | memoryview, out: bytearray) -> memoryview:
        """Like `seal`, writing into the caller's reusable buffer; returns the record's view."""
        return memoryview(out)[: self.seal_at(frame, out, 0)]

    def seal_at(self, frame: bytes | bytearray | memoryview, out: bytearray, pos: int) -> int:
        """Write the record of `frame` (prefix, ciphertext, tag) into `out` at `pos`, reading
        `frame` once and copying nothing; returns the position after the record."""
        n = len(frame) if type(frame) is not memoryview else frame.nbytes
        end = pos + PREFIX_BYTES + n + self.tag_bytes
        if len(out) < end:
            raise ValueError("output buffer too small")
        prefix = _PREFIX.pack(n + self.tag_bytes)
        out[pos : pos + PREFIX_BYTES] = prefix
        rc = self.suite.encrypt(
            ffi.cast("unsigned char *", ffi.from_buffer(out)) + (pos + PREFIX_BYTES),
            self._len,
            ffi.from_buffer(frame),
            n,
            prefix,
            PREFIX_BYTES,
            ffi.NULL,
            self._next_nonce(),
            self._key,
        )
        if rc != 0:
            raise RuntimeError("libsodium encryption failed")
        return end


class RecvCipher(_Direction):
    """Opens wire records; any failure is a `ProtocolError`."""

    def open_into(self, prefix: bytes, ciphertext: memoryview, out: bytearray) -> memoryview:
        """Decrypt `ciphertext` (the record body after `prefix`) into `out`; returns the plaintext view."""
        n = len(ciphertext)
        if n < self.tag_bytes:
            raise ProtocolError("record shorter than its tag")
        m = n - self.tag_bytes
        if len(out) < m:
            raise ValueError("output buffer too small")
        nonce = self._next_nonce()
        rc = self.suite.decrypt(
            ffi.from_buffer(out),
            self._len,
            ffi.NULL,
            ffi.from_buffer(ciphertext),
            n,
            prefix,
            PREFIX_BYTES,
            nonce,
            self._key,
        )
        if rc != 0:
            raise ProtocolError("record failed authentication (tampered, replayed or reordered)")
        return memoryview(out)[:m]

    def open_in_place(self, prefix: bytes, record: memoryview) -> memoryview:
        """Decrypt `record` (ciphertext and tag, the body after `prefix`) over itself; returns
        the plaintext view, `record` without its tag. On failure the contents are undefined."""
        n = record.nbytes
        if n < self.tag_bytes:
            raise ProtocolError("record shorter than its tag")
        buf = ffi.from_buffer(record, require_writable=True)
        rc = self.suite.decrypt(buf, self._len, ffi.NULL, buf, n, prefix, PREFIX_BYTES, self._next_nonce(), self._key)
        if rc != 0:
            raise ProtocolError("record failed authentication (tampered, replayed or reordered)")
        return record[: n - self.tag_bytes]

    def open(self, record: bytes) -> bytes:
        """Decrypt one whole record (prefix included); for tests and small frames."""
        if len(record) < PREFIX_BYTES:
            raise ProtocolError("truncated record")
        (n,) = _PREFIX.unpack_from(record, 0)
        if n != len(record) - PREFIX_BYTES:
            raise ProtocolError("record length does not match its prefix")
        out = bytearray(max(0, n - self.tag_bytes))
        return bytes(self.open_into(record[:PREFIX_BYTES], memoryview(record)[PREFIX_BYTES:], out))


def parse_prefix(prefix: bytes | memoryview, max_record_bytes: int, min_record_bytes: int = 16) -> int:
    """Length of the record body announced by a 4-byte prefix, refused if over the limit."""
    (n,) = _PREFIX.unpack_from(prefix, 0)
    if n > max_record_bytes:
        raise ProtocolError(f"record of {n} bytes exceeds the limit of {max_record_bytes}")
    if n < min_record_bytes:
        raise ProtocolError("record shorter than its tag")
    return n


def encode_prefix(n: int) -> bytes:
    return _PREFIX.pack(n)
