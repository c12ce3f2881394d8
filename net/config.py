"""`TransportConfig`: limits and timeouts of the peer transport, shared by the TCP transport
(`Transport`) and the in-memory one (`MemTransport`); `EmulationConfig`: the settings of the
test-swarm link emulator (emulation.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .session import SUITES

__all__ = ["EmulationConfig", "TransportConfig"]

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
    # Incomplete payloads a peer may have in flight to us at once, in count and in bytes (the
    # bytes bound the memory; the count, the bookkeeping: the data plane keeps up to 16 tensors
    # in flight to a neighbour, and gossip's probes and weight chunks share the connection).
    max_inflight_payloads: int = 64
    max_inflight_payload_bytes: int = 4096 * MiB
    # Incomplete incoming payloads over all connections together, in bytes: the memory many
    # connections may commit at once. A payload that does not fit is refused (a request gets
    # an error reply saying so), not allocated; its connection stays up.
    max_total_payload_bytes: int = 8192 * MiB
    # Default time a request waits for its reply (sending included).
    request_timeout_s: float = 30.0
    # TCP connect plus the three handshake messages; on the accepting side, from the hello to
    # the third message.
    handshake_timeout_s: float = 10.0
    # An accepted connection must deliver its whole hello within this long; until then it holds
    # no handshake slot, only a pending-connection place (bounded below).
    hello_timeout_s: float = 3.0
    # Accepted connections still waiting for their hello, over all sources and per source host
    # (an IPv6 source counts by its /64). Excess connections are closed at once.
    max_pending_connections: int = 256
    max_pending_per_host: int = 16
    # The initiator's wall clock travels in the hello under the swarm-key MAC; hellos further
    # than this from the responder's clock are refused, and a hello seen once within the window
    # is refused again. Too small refuses peers with drifting clocks.
    handshake_clock_skew_s: float = 120.0
    # Session keys are ratcheted after this long or this many records, whichever comes first;
    # the record counter is 64 bits, so the count limit sits far below a wrap.
    rekey_interval_s: float = 120.0
    rekey_after_records: int = 2**32
    # Handshakes in progress (hello received, third message awaited) at once, over all sources
    # and per source host (an IPv6 source counts by its /64); excess connections are closed.
    max_half_open_handshakes: int = 64
    max_half_open_per_host: int = 8
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
        if self.max_total_payload_bytes < self.max_payload_bytes:
            raise ValueError("max_total_payload_bytes must be >= max_payload_bytes")
        if self.max_inflight_payloads < 1:
            raise ValueError("max_inflight_payloads must be >= 1")
        for name in ("request_timeout_s", "handshake_timeout_s", "rekey_interval_s", "keepalive_interval_s",
                     "send_stall_timeout_s", "close_timeout_s", "handshake_rate_per_s", "hello_timeout_s",
                     "handshake_clock_skew_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.idle_timeout_s <= 2 * self.keepalive_interval_s:
            raise ValueError("idle_timeout_s must exceed 2 x keepalive_interval_s")
        if not 1 <= self.rekey_after_records <= 2**62:
            raise ValueError("rekey_after_records must be in 1..2^62")
        for name in ("max_half_open_handshakes", "max_half_open_per_host", "handshake_burst",
                     "max_pending_connections", "max_pending_per_host"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
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
            max_total_payload_bytes=256 * MiB,
            request_timeout_s=5.0,
            handshake_timeout_s=2.0,
            hello_timeout_s=1.0,
            max_pending_connections=64,
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


@dataclass(frozen=True)
class EmulationConfig:
    # > 1 slows the emulated network down uniformly (delay x, bandwidth /).
    time_scale: float = 1.0
    # Multiplies every link's bandwidth (on top of time_scale).
    bandwidth_scale: float = 1.0
    # Fraction of droppable frames (gossip datagrams) lost on every link.
    drop_fraction: float = 0.0
    # Token bucket depth: bytes that may leave back to back after an idle spell. Keep it small
    # next to the bandwidth probe (it inflates a timed transfer by up to burst/probe bytes).
    burst_bytes: int = 16 * 1024
    # Frames queued per link before submit() waits. Deeper: more buffering, later backpressure.
    queue_frames: int = 1024
    # True: one rate limiter per destination region, shared by all links to it (a site's
    # uplink); False: one per link (the scenario's per-pair bandwidth).
    share_region_bandwidth: bool = False

    def __post_init__(self) -> None:
        for name in ("time_scale", "bandwidth_scale"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if not 0.0 <= self.drop_fraction <= 1.0:
            raise ValueError(f"drop_fraction must be in [0, 1], got {self.drop_fraction}")
        if self.burst_bytes < 0 or self.queue_frames < 1:
            raise ValueError("burst_bytes must be >= 0 and queue_frames >= 1")
