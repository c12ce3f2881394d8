"""`TransportConfig`: limits and timeouts of the peer transport, shared by the TCP transport
(`Transport`) and the in-memory one (`MemTransport`)."""

from __future__ import annotations

from dataclasses import dataclass

from .session import SUITES

__all__ = ["TransportConfig"]

MiB = 1 << 20


@dataclass(frozen=True)
class TransportConfig:
    # Largest message frame (header + msgpack body). Bigger allows larger control messages; every
    # body is decoded in one go on the event loop, so it also bounds the time one decode takes.
    max_control_frame_bytes: int = 1 * MiB
    # Largest raw payload (tensor bytes) of one message; the receiver allocates it on the header.
    max_payload_bytes: int = 2048 * MiB
    # Payload bytes per chunk frame: smaller chunks let control frames overtake sooner, larger
    # ones cost fewer records and syscalls.
    chunk_bytes: int = 1 * MiB
    # Incomplete payloads a peer may have in flight to us at once, in count and in bytes.
    max_inflight_payloads: int = 16
    max_inflight_payload_bytes: int = 4096 * MiB
    # Default time a request waits for its reply (sending included).
    request_timeout_s: float = 30.0
    # TCP connect plus the three handshake messages.
    handshake_timeout_s: float = 10.0
    # Session keys are ratcheted after this long or this many records, whichever comes first;
    # the record counter is 64 bits, so the count limit sits far below a wrap.
    rekey_interval_s: float = 120.0
    rekey_after_records: int = 2**32
    # Handshakes in progress at once, over all sources; excess connections are closed at once.
    max_half_open_handshakes: int = 64
    # Handshake attempts per source host: sustained rate and burst (token bucket).
    handshake_rate_per_s: float = 5.0
    handshake_burst: int = 20
    # With nothing to send for this long a keepalive frame goes out; nothing received for
    # idle_timeout_s closes the connection. Keep idle > 2 x keepalive.
    keepalive_interval_s: float = 15.0
    idle_timeout_s: float = 60.0
    # A single record write that makes no progress for this long closes the connection.
    send_stall_timeout_s: float = 60.0
    # Time allowed to tell the peer why we close.
    close_timeout_s: float = 1.0
    # Handlers running at once per connection; more requests get a "busy" error reply.
    max_concurrent_handlers: int = 64
    # Control frames queued per connection before senders wait (droppable ones are dropped).
    max_queued_control_frames: int = 256
    # Records at least this large are encrypted/decrypted on worker threads, overlapping crypto
    # with socket I/O; 0 keeps all crypto on the event loop. Threads pay off with idle cores
    # to spare; on a busy 2-core host they cost about 0.6 CPU s per GiB in hand-offs.
    crypto_thread_min_bytes: int = 0
    # Record ciphers offered in the handshake, preferred first; None offers what this machine
    # runs fast (AEGIS-256 with hardware AES, and ChaCha20-Poly1305).
    cipher_suites: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_control_frame_bytes < 1024:
            raise ValueError("max_control_frame_bytes must be at least 1024")
        if self.chunk_bytes < 1 or self.chunk_bytes > 64 * MiB:
            raise ValueError("chunk_bytes must be in 1..64 MiB")
        if self.max_payload_bytes < 0 or self.max_inflight_payload_bytes < self.max_payload_bytes:
            raise ValueError("need 0 <= max_payload_bytes <= max_inflight_payload_bytes")
        if self.max_inflight_payloads < 1:
            raise ValueError("max_inflight_payloads must be >= 1")
        for name in ("request_timeout_s", "handshake_timeout_s", "rekey_interval_s", "keepalive_interval_s",
                     "send_stall_timeout_s", "close_timeout_s", "handshake_rate_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.idle_timeout_s <= 2 * self.keepalive_interval_s:
            raise ValueError("idle_timeout_s must exceed 2 x keepalive_interval_s")
        if not 1 <= self.rekey_after_records <= 2**62:
            raise ValueError("rekey_after_records must be in 1..2^62")
        if self.max_half_open_handshakes < 1 or self.handshake_burst < 1:
            raise ValueError("max_half_open_handshakes and handshake_burst must be >= 1")
        if self.cipher_suites is not None and (
            not self.cipher_suites or any(c not in SUITES for c in self.cipher_suites)
        ):
            raise ValueError(f"cipher_suites must be a non-empty subset of {sorted(SUITES)}")
        if self.crypto_thread_min_bytes < 0:
            raise ValueError("crypto_thread_min_bytes must be >= 0")
        if self.max_concurrent_handlers < 1 or self.max_queued_control_frames < 1:
            raise ValueError("max_concurrent_handlers and max_queued_control_frames must be >= 1")

    @classmethod
    def default(cls) -> TransportConfig:
        return cls()

    @classmethod
    def test(cls) -> TransportConfig:
        """Small limits and short timeouts; renews keys often so tests exercise renewal."""
        return cls(
            max_control_frame_bytes=64 * 1024,
            max_payload_bytes=64 * MiB,
            chunk_bytes=64 * 1024,
            max_inflight_payload_bytes=128 * MiB,
            request_timeout_s=5.0,
            handshake_timeout_s=2.0,
            rekey_interval_s=10.0,
            rekey_after_records=64,
            max_half_open_handshakes=16,
            handshake_rate_per_s=50.0,
            handshake_burst=50,
            keepalive_interval_s=2.0,
            idle_timeout_s=10.0,
            send_stall_timeout_s=5.0,
            close_timeout_s=0.5,
        )
