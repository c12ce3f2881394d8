"""Network and compute measurement: round-trip time, bandwidth and compute speed.

Written against a small async interface, `PeerLink.request(msg_type, body, *, payload,
timeout_s) -> (body, payload)` (what `dtfm.net.Connection` provides), so the same
code runs over the real transport and over the in-memory network. `MeasurePlanner` decides
whom to measure next and when, without I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import random
import statistics
from dataclasses import dataclass
from typing import Protocol

import trio

from dtfm.net import ConnectionClosed, ProtocolError, RemoteError, RequestTimeout, get_int

from .messages import MsgType
from .records import MAX_GBPS, MAX_RTT_MS, Entry

__all__ = ["MeasurePing", "BulkProbe", "PeerLink", "measure_rtt", "measure_bandwidth", "MeasurePlanner", "BulkGate",
           "compute_speed_ms", "BULK_RESERVE", "BULK_DATA", "serve_ping", "serve_bulk", "probe_hash",
           "PROBE_HASH_BYTES"]

logger = logging.getLogger(__name__)

BULK_RESERVE = 0
BULK_DATA = 1
MAX_BULK_BYTES = 64 * 1024 * 1024
PROBE_HASH_BYTES = 16
# What a request to a reachable peer may fail with: no reply in time, the connection went
# away, or the peer answered with an error (busy, no handler). Anything else is a bug.
_REQUEST_ERRORS = (RequestTimeout, ConnectionClosed, RemoteError)


@dataclass(frozen=True)
class MeasurePing:
    """A ping of an RTT measurement; the reply echoes it."""

    n: int
    type = MsgType.MEASURE_PING

    def to_wire(self) -> dict:
        return {"n": self.n}

    @classmethod
    def from_wire(cls, body: object) -> "MeasurePing":
        if not isinstance(body, dict):
            raise ProtocolError("ping: expected a map")
        return cls(get_int(body, "n", 0, 1 << 30))


@dataclass(frozen=True)
class BulkProbe:
    """A bandwidth probe: op BULK_RESERVE (no payload) or BULK_DATA (payload of n bytes)."""

    op: int
    n: int
    type = MsgType.MEASURE_BULK

    def to_wire(self) -> dict:
        return {"op": self.op, "n": self.n}

    @classmethod
    def from_wire(cls, body: object) -> "BulkProbe":
        if not isinstance(body, dict):
            raise ProtocolError("bulk probe: expected a map")
        return cls(get_int(body, "op", BULK_RESERVE, BULK_DATA), get_int(body, "n", 1, MAX_BULK_BYTES))


class PeerLink(Protocol):
    peer_id: bytes

    async def request(self, msg_type: int, body, *, payload: bytes | None = None,
                      timeout_s: float | None = None) -> tuple[object, bytes | None]: ...


async def measure_rtt(link: PeerLink, samples: int, spacing_s: float, timeout_s: float) -> list[float]:
    """Round-trip times in seconds of `samples` pings sent `spacing_s` apart, each timed on its
    own (failed pings are left out). A ping does not wait for the reply to the one before it, so
    a far link costs one round trip plus the spacing, not a round trip per sample."""
    out: list[float] = []

    async def ping(i: int) -> None:
        t0 = trio.current_time()
        try:
            body, _ = await link.request(MsgType.MEASURE_PING, MeasurePing(i).to_wire(), timeout_s=timeout_s)
        except _REQUEST_ERRORS as e:  # the sample is lost
            logger.debug("ping %s: %s", link.peer_id[:4].hex(), e)
            return
        if isinstance(body, dict) and body.get("n") == i:
            out.append(trio.current_time() - t0)

    try:
        async with trio.open_nursery() as nursery:
            for i in range(samples):
                if i and spacing_s > 0:
                    await trio.sleep(spacing_s)
                nursery.start_soon(ping, i)
    except BaseExceptionGroup as group:  # a bug below (not a lost sample): raised as itself
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return out


class BulkGate:
    """Links being measured, in either direction: a big probe or this peer's RTT pings. Never
    two at once on one link: pings queued behind a probe's payload would time the transfer."""

    def __init__(self) -> None:
        self.probing: set[bytes] = set()  # our own probe or pings to this peer are running
        self.serving: dict[bytes, float] = {}  # this peer reserved a probe to us, until when

    def busy(self, peer_id: bytes, now: float) -> bool:
        return peer_id in self.probing or self.serving.get(peer_id, -1.0) > now


def probe_hash(payload: bytes) -> bytes:
    """What the target of a bandwidth probe answers: proof that the whole payload arrived."""
    return hashlib.blake2b(payload, digest_size=PROBE_HASH_BYTES, person=b"dtfm-bulk").digest()


async def measure_bandwidth(link: PeerLink, gate: BulkGate, nbytes: int, rtt_s: float,
                            timeout_s: float) -> float | None:
    """Gbps of one timed transfer of nbytes, or None when the link is busy or it failed.

    The payload is random and the reply must carry its hash (`probe_hash`), so the clock stops
    only once the target proves it received every byte: it cannot answer early to inflate
    the link. Payload and hash are made before the clock starts.
    """
    pid = link.peer_id
    if gate.busy(pid, trio.current_time()):
        return None
    payload = os.urandom(nbytes)
    expected = probe_hash(payload)
    gate.probing.add(pid)
    try:
        t0 = trio.current_time()
        body, _ = await link.request(MsgType.MEASURE_BULK, BulkProbe(BULK_RESERVE, nbytes).to_wire(),
                                     timeout_s=timeout_s)
        if not isinstance(body, dict) or body.get("ok") is not True:
            return None
        # The reservation is itself a round trip on the now quiet link: the pings before it
        # may have queued behind the other end's own big probe.
        rtt_s = min(rtt_s, trio.current_time() - t0)
        t0 = trio.current_time()
        body, _ = await link.request(MsgType.MEASURE_BULK, BulkProbe(BULK_DATA, nbytes).to_wire(),
                                     payload=payload, timeout_s=timeout_s)
        elapsed = trio.current_time() - t0
    except _REQUEST_ERRORS as e:
        logger.debug("bandwidth probe to %s failed: %s", pid[:4].hex(), e)
        return None
    finally:
        gate.probing.discard(pid)
    problem = _reply_problem(body, nbytes, expected)
    if problem is not None:
        logger.warning("bandwidth probe to %s discarded: %s", pid[:4].hex(), problem)
        return None
    transfer_s = elapsed - rtt_s
    if transfer_s <= 0:
        return MAX_GBPS
    return min(MAX_GBPS, nbytes * 8 / transfer_s / 1e9)


def _reply_problem(body: object, nbytes: int, expected: bytes) -> str | None:
    """Why a reply to BULK_DATA does not prove the payload arrived; None when it does."""
    if not isinstance(body, dict):
        return "reply is not a map"
    if body.get("n") != nbytes:
        return f"reply counts {body.get('n')!r} bytes, sent {nbytes}"
    digest = body.get("hash")
    if not isinstance(digest, bytes):
        return "reply carries no hash of the payload"
    if not hmac.compare_digest(digest, expected):
        return "reply carries a wrong hash of the payload"
    return None


async def serve_ping(body) -> dict:
    await trio.lowlevel.checkpoint()
    return MeasurePing.from_wire(body).to_wire()


def serve_bulk(gate: BulkGate, peer_id: bytes, body, payload: bytes | None, now: float,
               hold_s: float) -> dict:
    probe = BulkProbe.from_wire(body)
    op, n = probe.op, probe.n
    if op == BULK_RESERVE:
        if gate.busy(peer_id, now):
            return {"ok": False}
        gate.serving[peer_id] = now + hold_s
        return {"ok": True}
    gate.serving.pop(peer_id, None)
    if payload is None or len(payload) != n:
        raise ProtocolError("bulk probe: payload length does not match")
    return {"n": n, "hash": probe_hash(payload)}


@dataclass
class _Link:
    rtt_ms: float | None = None
    samples: int = 0
    bandwidth_gbps: float = 0.0
    measured_at: float = float("-inf")


class MeasurePlanner:
    """Whom to measure next: never-measured peers first, then the stalest past the
    re-measure interval; big probes spaced by a jittered interval."""

    def __init__(self, remeasure_s: float, bulk_interval_s: float, jitter: float,
                 rng: random.Random) -> None:
        self.remeasure_s = remeasure_s
        self.bulk_interval_s = bulk_interval_s
        self.jitter = jitter
        self._rng = rng
        self.links: dict[bytes, _Link] = {}
        self.next_bulk_at = 0.0
        self.version = 0

    def next_target(self, candidates, now: float) -> bytes | None:
        fresh = [p for p in candidates if self.links.get(p, _Link()).bandwidth_gbps <= 0
                 or now - self.links[p].measured_at >= self.remeasure_s]
        if not fresh:
            return None
        never = [p for p in fresh if p not in self.links]
        if never:
            return self._rng.choice(never)
        return min(fresh, key=lambda p: self.links[p].measured_at)

    def bulk_wait_s(self, now: float) -> float:
        return max(0.0, self.next_bulk_at - now)

    def record(self, target: bytes, rtts_s: list[float], gbps: float | None, now: float) -> None:
        link = self.links.setdefault(target, _Link())
        if rtts_s:
            link.rtt_ms = min(MAX_RTT_MS, max(1e-6, statistics.median(rtts_s) * 1000.0))
            link.samples = len(rtts_s)
        if gbps is not None:
            link.bandwidth_gbps = gbps
            j = self.jitter
            self.next_bulk_at = now + self.bulk_interval_s * self._rng.uniform(1 - j, 1 + j)
        link.measured_at = now
        self.version += 1

    def forget(self, peer_id: bytes) -> None:
        if self.links.pop(peer_id, None) is not None:
            self.version += 1

    def entries(self) -> list[Entry]:
        return [Entry(p, link.rtt_ms, link.bandwidth_gbps, link.samples)
                for p, link in self.links.items() if link.rtt_ms is not None]


def compute_speed_ms(d_model: int = 256, n_heads: int = 4, seq_len: int = 128, batch: int = 4,
                     repeats: int = 3, seed: int = 0) -> float:
    """Median ms of forward+backward of one transformer block (CPU or the default device).

    Blocking: run it in a thread (trio.to_thread.run_sync).
    """
    import time

    import torch  # lazily: only this probe needs torch

    torch.manual_seed(seed)
    block = torch.nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0,
                                             batch_first=True)
    x = torch.randn(batch, seq_len, d_model)  # (B, T, C)
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        t0 = time.perf_counter()
        block(x).sum().backward()
        times.append((time.perf_counter() - t0) * 1000.0)
        block.zero_grad(set_to_none=True)
    return statistics.median(times[1:])
