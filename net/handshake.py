"""The handshake, as sans-IO state machines (`Initiator`, `Responder`).

Three messages, each sent as `u32 length | body`:

    1. I -> R  "DTFM" | version | t_ms (u64) | e_i (32) | mac1 (16)
               t_ms is the initiator's wall clock in milliseconds;
               mac1 = BLAKE2b-MAC(swarm key, "DTFM" | version | t_ms | e_i).
    2. R -> I  "DTFM" | version | e_r (32) | AEAD(k_r, h, {id, sig, region, listen})
    3. I -> R  AEAD(k_i, h, {id, sig, region, listen})

What mac1 proves: that the hello was made by a holder of the swarm key, within
`HelloGuard.skew_s` of the responder's clock, and was not seen before (the responder's
`HelloGuard` remembers every hello of the window). So someone without the key can neither make
a hello nor replay one recorded off the wire to make the responder spend a key exchange. It
proves nothing about who the sender is: every swarm member can make fresh hellos, and the
responder spends a key exchange and a handshake slot on each (admission control bounds that
per source). A refused hello (wrong MAC, version, clock or a replay) gets one generic plaintext
refusal, "DTFM" | 0xff | "handshake refused"; the responder keeps the detail for its own log.

h = BLAKE2b(msg1 | "DTFM" | version | e_r) is the transcript; each side signs
"dtfm-hs-resp"/"dtfm-hs-init" | h with its Ed25519 identity key. Every key is derived from the
ephemeral X25519 secret *and* the swarm key, so only swarm members can complete a handshake,
and past traffic stays secret if an identity key later leaks. Session keys: one per direction.
Each side lists the record ciphers it runs fast; both pick AEGIS-256 if both list it, else
ChaCha20-Poly1305 (`session.choose_suite`). The lists travel inside the AEAD-protected
blobs, so nobody without the swarm key can downgrade them.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass

import nacl.bindings
import nacl.exceptions
import nacl.utils

from .errors import HandshakeError, ProtocolError
from .identity import Identity, short_id, swarm_key_fingerprint, verify_signature
from .replay import HelloGuard
from .session import SUITES, choose_suite, local_suites
from .wire import get_bytes, get_dict, get_int, get_list, get_str, pack, unpack_untrusted

PROTOCOL_VERSION = 3  # 3: gossip reports carry coding speeds; weights-only fetches for exports
MAGIC = b"DTFM"
REJECT = 0xFF
MAX_HANDSHAKE_BYTES = 2048
MAX_REGION_LEN = 64
MAX_HOST_LEN = 255
DEFAULT_CLOCK_SKEW_S = 120.0
# The only refusal a responder sends, whatever the reason: the reason stays in its own log.
REFUSAL = "handshake refused"
_MAC_BYTES = 16
_TIME_BYTES = 8
_HEADER_LEN = len(MAGIC) + 1 + _TIME_BYTES + 32
MSG1_LEN = _HEADER_LEN + _MAC_BYTES
_REFUSAL_HINT = (
    "check that both peers hold the same swarm key, run the same dtfm version, and have clocks "
    "within two minutes of each other"
)
_NONCE0 = bytes(12)


@dataclass(frozen=True)
class PeerHello:
    """What each side tells the other about itself in the handshake."""

    region: str
    listen_address: tuple[str, int]


@dataclass(frozen=True)
class HandshakeResult:
    peer_id: bytes
    hello: PeerHello
    send_key: bytes
    recv_key: bytes
    suite: str = "chacha20poly1305"  # the record cipher both sides chose

    @property
    def short_id(self) -> str:
        return short_id(self.peer_id)


def reject_message(reason: str) -> bytes:
    return MAGIC + bytes([REJECT]) + reason.encode("utf-8", "replace")[:512]


def _kdf(key: bytes, data: bytes, person: bytes) -> bytes:
    return hashlib.blake2b(data, key=key, digest_size=32, person=person).digest()


def _mac1(swarm_key: bytes, header: bytes) -> bytes:
    return hashlib.blake2b(header, key=swarm_key, digest_size=_MAC_BYTES, person=b"dtfm-hs-mac1").digest()


class _Side:
    def __init__(
        self, identity: Identity, swarm_key: bytes, hello: PeerHello, suites: list[str] | None = None
    ) -> None:
        if len(swarm_key) != 32:
            raise ValueError("the swarm key is 32 bytes")
        self._suites = list(local_suites() if suites is None else suites)
        if not self._suites or any(name not in SUITES for name in self._suites):
            raise ValueError(f"cipher suites must be among {sorted(SUITES)}")
        self._identity = identity
        self._swarm_key = bytes(swarm_key)
        self._hello = hello
        self._e_priv = nacl.utils.random(32)
        self._e_pub = nacl.bindings.crypto_scalarmult_base(self._e_priv)

    def _derive(self, peer_e_pub: bytes, transcript: bytes) -> dict[str, bytes]:
        try:
            dh = nacl.bindings.crypto_scalarmult(self._e_priv, peer_e_pub)
        except (nacl.exceptions.CryptoError, ValueError, TypeError):
            raise HandshakeError("peer sent an invalid ephemeral key") from None
        ck = _kdf(self._swarm_key, dh + transcript, b"dtfm-hs-ck")
        self._e_priv = b""
        return {name: _kdf(ck, b"", b"dtfm-" + name.encode()) for name in ("hs-r", "hs-i", "i2r", "r2i")}

    def _identity_blob(self, key: bytes, transcript: bytes, label: bytes) -> bytes:
        body = {
            "id": self._identity.peer_id,
            "sig": self._identity.sign(label + transcript),
            "region": self._hello.region,
            "listen": [self._hello.listen_address[0], self._hello.listen_address[1]],
            "ciphers": self._suites,
        }
        return nacl.bindings.crypto_aead_chacha20poly1305_ietf_encrypt(pack(body), transcript, _NONCE0, key)

    def _open_identity(
        self, blob: bytes, key: bytes, transcript: bytes, label: bytes
    ) -> tuple[bytes, PeerHello, list[str]]:
        try:
            plain = nacl.bindings.crypto_aead_chacha20poly1305_ietf_decrypt(blob, transcript, _NONCE0, key)
        except (nacl.exceptions.CryptoError, ValueError, TypeError):
            raise HandshakeError(
                "swarm key mismatch: the peer's handshake does not decrypt with our swarm key "
                f"(ours has fingerprint {swarm_key_fingerprint(self._swarm_key)}); "
                "it is not in this swarm"
            ) from None
        d = get_dict(unpack_untrusted(plain, max_len=MAX_HANDSHAKE_BYTES), "handshake")
        peer_id = get_bytes(d, "id", 32, 32)
        sig = get_bytes(d, "sig", 64, 64)
        region = get_str(d, "region", MAX_REGION_LEN)
        listen = get_list(d, "listen", 2)
        if len(listen) != 2:
            raise ProtocolError("listen address must be [host, port]")
        host = get_str({"h": listen[0]}, "h", MAX_HOST_LEN)
        port = get_int({"p": listen[1]}, "p", 0, 65535)
        ciphers = [get_str({"c": c}, "c", 32) for c in get_list(d, "ciphers", 8)]
        if not verify_signature(peer_id, label + transcript, sig):
            raise HandshakeError(f"peer {short_id(peer_id)} failed to prove its identity key")
        if peer_id == self._identity.peer_id:
            raise HandshakeError("connected to ourselves (same identity key)")
        return peer_id, PeerHello(region=region, listen_address=(host, port)), ciphers


def _check_reject(msg: bytes) -> None:
    if len(msg) >= 5 and msg[:4] == MAGIC and msg[4] == REJECT:
        reason = msg[5 : 5 + 128].decode("utf-8", "replace")
        printable = "".join(c if c.isprintable() else "?" for c in reason)
        raise HandshakeError(f"refused by peer: {printable} ({_REFUSAL_HINT})")


class Initiator(_Side):
    """The connecting side: `first_message()`, then `on_response(msg2) -> (msg3, result)`.

    `wall_clock()` gives the time (seconds since the epoch) put in the hello."""

    def __init__(self, identity: Identity, swarm_key: bytes, hello: PeerHello, suites: list[str] | None = None,
                 *, wall_clock: Callable[[], float] = time.time) -> None:
        super().__init__(identity, swarm_key, hello, suites)
        self._wall_clock = wall_clock

    def first_message(self) -> bytes:
        t_ms = min(max(0, int(self._wall_clock() * 1000)), 2**64 - 1)
        header = MAGIC + bytes([PROTOCOL_VERSION]) + t_ms.to_bytes(_TIME_BYTES, "big") + self._e_pub
        self._msg1 = header + _mac1(self._swarm_key, header)
        return self._msg1

    def on_response(self, msg2: bytes) -> tuple[bytes, HandshakeResult]:
        _check_reject(msg2)
        if len(msg2) < 5 + 32 + 16 or msg2[:4] != MAGIC:
            raise ProtocolError("malformed handshake response")
        if msg2[4] != PROTOCOL_VERSION:
            raise HandshakeError(f"peer speaks protocol version {msg2[4]}, we speak {PROTOCOL_VERSION}")
        e_r = bytes(msg2[5:37])
        transcript = hashlib.blake2b(self._msg1 + bytes(msg2[:37]), digest_size=32).digest()
        keys = self._derive(e_r, transcript)
        peer_id, hello, theirs = self._open_identity(bytes(msg2[37:]), keys["hs-r"], transcript, b"dtfm-hs-resp")
        suite = choose_suite(self._suites, theirs)
        msg3 = self._identity_blob(keys["hs-i"], transcript, b"dtfm-hs-init")
        return msg3, HandshakeResult(peer_id, hello, send_key=keys["i2r"], recv_key=keys["r2i"], suite=suite)


class Responder(_Side):
    """The accepting side: `on_hello(msg1) -> msg2`, then `on_finish(msg3) -> result`.

    A `HandshakeError` from `on_hello` says why the hello was refused, for the responder's own
    log; the peer is sent `reject_message(REFUSAL)` and nothing more. `guard` checks the hello's
    time and that it was not seen before; share one among a transport's responders (a fresh one
    per responder checks only the time). `wall_clock()` is the responder's clock for that check.
    """

    def __init__(self, identity: Identity, swarm_key: bytes, hello: PeerHello, suites: list[str] | None = None,
                 *, guard: HelloGuard | None = None, wall_clock: Callable[[], float] = time.time) -> None:
        super().__init__(identity, swarm_key, hello, suites)
        self._guard = guard if guard is not None else HelloGuard(DEFAULT_CLOCK_SKEW_S, max_entries=1)
        self._wall_clock = wall_clock

    def on_hello(self, msg1: bytes) -> bytes:
        if len(msg1) < 5 or msg1[:4] != MAGIC:
            raise ProtocolError("not a dtfm handshake")
        if msg1[4] != PROTOCOL_VERSION:
            raise HandshakeError(f"protocol version {msg1[4]} not supported (we speak {PROTOCOL_VERSION})")
        if len(msg1) != MSG1_LEN:
            raise ProtocolError("malformed handshake hello")
        header, mac = bytes(msg1[:-_MAC_BYTES]), bytes(msg1[-_MAC_BYTES:])
        if not hmac.compare_digest(mac, _mac1(self._swarm_key, header)):
            raise HandshakeError(
                "swarm key mismatch: the connecting peer does not hold this swarm's key "
                f"(ours has fingerprint {swarm_key_fingerprint(self._swarm_key)})"
            )
        sent_s = int.from_bytes(header[5 : 5 + _TIME_BYTES], "big") / 1000
        stale = self._guard.check(mac, sent_s, self._wall_clock())
        if stale is not None:
            raise HandshakeError(stale)
        e_i = header[5 + _TIME_BYTES : _HEADER_LEN]
        msg2_head = MAGIC + bytes([PROTOCOL_VERSION]) + self._e_pub
        self._transcript = hashlib.blake2b(bytes(msg1) + msg2_head, digest_size=32).digest()
        self._keys = self._derive(e_i, self._transcript)
        return msg2_head + self._identity_blob(self._keys["hs-r"], self._transcript, b"dtfm-hs-resp")

    def on_finish(self, msg3: bytes) -> HandshakeResult:
        peer_id, hello, theirs = self._open_identity(bytes(msg3), self._keys["hs-i"], self._transcript, b"dtfm-hs-init")
        suite = choose_suite(theirs, self._suites)
        return HandshakeResult(peer_id, hello, send_key=self._keys["r2i"], recv_key=self._keys["i2r"], suite=suite)
