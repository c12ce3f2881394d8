"""Network and compute measurement: round-trip time, bandwidth and compute speed.

Written against a small async interface, `PeerLink.request(msg_type, body, *, payload,
timeout_s) -> (body, payload)` (what `dtfm.net.Connection` provides), so the same
code runs over the real transport and over the in-memory network. `MeasurePlanner` decides
what to measure next and when, without I/O (`next_job`):

- links asked for (`ask`: the links of a plan the control plane confirms) first, each at
  most once per `confirm_fresh_s`;
- in a small swarm (at most `full_mesh_max_peers` others) every link, as all-pairs
  measurement always did; past that, links to `capacity_peers` random peers only, enough
  for this peer's own upload and download capacity (`capacity()`);
- one round trip to a random peer every `coord_interval_s`, for the network coordinate.

Big probes (a timed upload, and a timed download: `BULK_PULL`) are spaced by a jittered
`bulk_interval_s`, asked links excepted.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import math
import os
import random
import statistics
from dataclasses import dataclass
from collections.abc import Iterable, Sequence
from typing import Protocol

import trio

from dtfm.net import (PEER_ID_BYTES, ConnectionClosed, ProtocolError, RemoteError, Reply, RequestTimeout, get_bytes,
                      get_int, get_list)

from .messages import MsgType
from .config import GossipConfig
from .records import MAX_GBPS, MAX_RTT_MS, Entry, Report, check_coord
from .reference import PROBE_MIN_RUNS, PROBE_MIN_S, REFERENCE_BLOCK, mean_ms, reference_block, time_block_ms
from .vivaldi import Coordinate

__all__ = ["MeasurePing", "BulkProbe", "PeerLink", "measure_rtt", "measure_bandwidth", "MeasurePlanner", "BulkGate",
           "compute_speed_ms", "BULK_RESERVE", "BULK_DATA", "serve_ping", "serve_bulk", "probe_hash",
           "PROBE_HASH_BYTES", "BULK_PULL", "measure_download", "MeasureJob", "JobKind", "MAX_PULL_BYTES",
           "MeasureLinks", "MAX_ASK_TARGETS", "report_due"]

logger = logging.getLogger(__name__)

BULK_RESERVE = 0
BULK_DATA = 1
BULK_PULL = 2  # a timed download: the target answers with n random bytes
MAX_BULK_BYTES = 64 * 1024 * 1024
MAX_PULL_BYTES = 4 * 1024 * 1024  # what a peer sends for one download probe, at most
PROBE_HASH_BYTES = 16
# What a request to a reachable peer may fail with: no reply in time, the connection went
# away, or the peer answered with an error (busy, no handler). Anything else is a bug.
_REQUEST_ERRORS = (RequestTimeout, ConnectionClosed, RemoteError)


@dataclass(frozen=True)
class MeasurePing:
    """A ping of an RTT measurement; the reply echoes it, with the responder's network
    coordinate (`coord`, empty when it has none yet or in the ping itself)."""

    n: int
    coord: tuple[float, ...] = ()
    type = MsgType.MEASURE_PING

    def to_wire(self) -> dict:
        out: dict = {"n": self.n}
        if self.coord:
            out["c"] = [float(v) for v in self.coord]
        return out

    @classmethod
    def from_wire(cls, body: object) -> "MeasurePing":
        if not isinstance(body, dict):
            raise ProtocolError("ping: expected a map")
        return cls(get_int(body, "n", 0, 1 << 30), check_coord(body.get("c", [])))


@dataclass(frozen=True)
class BulkProbe:
    """A bandwidth probe: op BULK_RESERVE (no payload), BULK_DATA (payload of n bytes) or
    BULK_PULL (asks for n bytes back, at most MAX_PULL_BYTES)."""

    op: int
    n: int
    type = MsgType.MEASURE_BULK

    def to_wire(self) -> dict:
        return {"op": self.op, "n": self.n}

    @classmethod
    def from_wire(cls, body: object) -> "BulkProbe":
        if not isinstance(body, dict):
            raise ProtocolError("bulk probe: expected a map")
        op = get_int(body, "op", BULK_RESERVE, BULK_PULL)
        return cls(op, get_int(body, "n", 1, MAX_PULL_BYTES if op == BULK_PULL else MAX_BULK_BYTES))


MAX_ASK_TARGETS = 256  # links one request to measure names at most
FAST_COORD_JOBS = 32  # coordinate samples taken at four times the rate, from the start


@dataclass(frozen=True)
class MeasureLinks:
    """A request to measure the links to `targets` now (a plan's links, before it is handed
    out); the reply carries the measurer's new signed report (`{"report": ...}`)."""

    targets: tuple[bytes, ...]
    type = MsgType.MEASURE_LINKS

    def to_wire(self) -> dict:
        return {"targets": list(self.targets)}

    @classmethod
    def from_wire(cls, body: object) -> "MeasureLinks":
        if not isinstance(body, dict):
            raise ProtocolError("measure links: expected a map")
        raw = get_list(body, "targets", MAX_ASK_TARGETS)
        targets = tuple(get_bytes({"t": t}, "t", PEER_ID_BYTES, PEER_ID_BYTES) for t in raw)
        if len(set(targets)) != len(targets):
            raise ProtocolError("measure links: a target listed twice")
        return cls(targets)


class PeerLink(Protocol):
    peer_id: bytes

    async def request(self, msg_type: int, body: object, *, payload: bytes | bytearray | memoryview | None = None,
                      timeout_s: float | None = None) -> tuple[object, memoryview | None]: ...


async def measure_rtt(link: PeerLink, samples: int, spacing_s: float, timeout_s: float,
                      replies: list[MeasurePing] | None = None) -> list[float]:
    """Round-trip times in seconds of `samples` pings sent `spacing_s` apart, each timed on its
    own (failed pings are left out). A ping does not wait for the reply to the one before it, so
    a far link costs one round trip plus the spacing, not a round trip per sample. `replies`
    collects the well-formed replies (they carry the other end's coordinate)."""
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
            if replies is not None:
                try:
                    replies.append(MeasurePing.from_wire(body))
                except ProtocolError as e:
                    logger.debug("ping reply from %s: %s", link.peer_id[:4].hex(), e)

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


def probe_hash(payload: bytes | memoryview) -> bytes:
    """What the target of a bandwidth probe answers: proof that the whole payload arrived."""
    return hashlib.blake2b(payload, digest_size=PROBE_HASH_BYTES, person=b"dtfm-bulk").digest()


async def measure_bandwidth(link: PeerLink, gate: BulkGate, nbytes: int, rtt_s: float,
                            timeout_s: float) -> float | None:
    """Gbps of one timed transfer of nbytes, or None when the link is busy or it failed.

    The payload is random and the reply must carry its hash (`probe_hash`), so the clock stops
    only once the target proves it received every byte: it cannot answer early to inflate
    the link. Payload and hash are made before the clock starts.
    """
    payload = os.urandom(nbytes)
    expected = probe_hash(payload)
    timed = await _timed_exchange(link, gate, BulkProbe(BULK_DATA, nbytes), payload, rtt_s, timeout_s, "bandwidth")
    if timed is None:
        return None
    body, _, transfer_s = timed
    problem = _reply_problem(body, nbytes, expected)
    if problem is not None:
        logger.warning("bandwidth probe to %s discarded: %s", link.peer_id[:4].hex(), problem)
        return None
    return _gbps(nbytes, transfer_s)


async def measure_download(link: PeerLink, gate: BulkGate, nbytes: int, rtt_s: float,
                           timeout_s: float) -> float | None:
    """Gbps of one timed download of nbytes (BULK_PULL) from the peer, or None when the link
    is busy or it failed. The other end cannot make it look faster than its link carries the
    bytes: the clock stops when the last of them arrived."""
    timed = await _timed_exchange(link, gate, BulkProbe(BULK_PULL, nbytes), None, rtt_s, timeout_s, "download")
    if timed is None:
        return None
    _, payload, transfer_s = timed
    if payload is None or len(payload) != nbytes:
        logger.warning("download probe from %s discarded: %s bytes, asked %d", link.peer_id[:4].hex(),
                       None if payload is None else len(payload), nbytes)
        return None
    return _gbps(nbytes, transfer_s)


async def _timed_exchange(link: PeerLink, gate: BulkGate, probe: BulkProbe, payload: bytes | None, rtt_s: float,
                          timeout_s: float, what: str) -> tuple[object, memoryview | None, float] | None:
    """One big probe on a reserved link: the reservation (a round trip on the now quiet link:
    the pings before it may have queued behind the other end's own big probe), then `probe`
    timed; (reply body, reply payload, seconds of transfer: elapsed less the round trip), or
    None when the link is busy or a request failed."""
    pid = link.peer_id
    if gate.busy(pid, trio.current_time()):
        return None
    gate.probing.add(pid)
    try:
        t0 = trio.current_time()
        body, _ = await link.request(MsgType.MEASURE_BULK, BulkProbe(BULK_RESERVE, probe.n).to_wire(),
                                     timeout_s=timeout_s)
        if not isinstance(body, dict) or body.get("ok") is not True:
            return None
        rtt_s = min(rtt_s, trio.current_time() - t0)
        t0 = trio.current_time()
        body, reply = await link.request(MsgType.MEASURE_BULK, probe.to_wire(), payload=payload, timeout_s=timeout_s)
        elapsed = trio.current_time() - t0
    except _REQUEST_ERRORS as e:
        logger.debug("%s probe with %s failed: %s", what, pid[:4].hex(), e)
        return None
    finally:
        gate.probing.discard(pid)
    return body, reply, elapsed - rtt_s


def _gbps(nbytes: int, transfer_s: float) -> float:
    return MAX_GBPS if transfer_s <= 0 else min(MAX_GBPS, nbytes * 8 / transfer_s / 1e9)


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


async def serve_ping(body: object, coord: tuple[float, ...] = ()) -> dict:
    await trio.lowlevel.checkpoint()
    return MeasurePing(MeasurePing.from_wire(body).n, coord).to_wire()


def serve_bulk(gate: BulkGate, peer_id: bytes, body: object, payload: bytes | memoryview | None, now: float,
               hold_s: float) -> dict | Reply:
    """The answer to a bandwidth probe: a reservation, the hash of an upload, or (BULK_PULL,
    only within a reservation) n random bytes."""
    probe = BulkProbe.from_wire(body)
    op, n = probe.op, probe.n
    if op == BULK_RESERVE:
        if gate.busy(peer_id, now):
            return {"ok": False}
        gate.serving[peer_id] = now + hold_s
        return {"ok": True}
    if op == BULK_PULL:
        # The reservation stays for hold_s: the payload is on its way out after this returns,
        # and our own pings to that peer would queue behind it.
        if gate.serving.get(peer_id, -1.0) <= now:
            return {"ok": False}
        return Reply({"n": n}, os.urandom(n))
    gate.serving.pop(peer_id, None)
    if payload is None or len(payload) != n:
        raise ProtocolError("bulk probe: payload length does not match")
    return {"n": n, "hash": probe_hash(payload)}


@dataclass
class _Link:
    rtt_ms: float | None = None
    samples: int = 0
    bandwidth_gbps: float = 0.0
    measured_at: float = float("-inf")  # the last full measurement (or failed try)
    bandwidth_at: float = float("-inf")  # when bandwidth_gbps was measured
    download_gbps: float = 0.0  # a timed download from this peer; 0: none
    download_at: float = float("-inf")
    asked_at: float = float("-inf")  # when the link was last asked for (confirm)


class JobKind(enum.Enum):
    LINK = "link"  # round trips and a timed upload (and a download when `pull`)
    COORD = "coord"  # one round trip, for the network coordinate


@dataclass(frozen=True)
class MeasureJob:
    kind: JobKind
    target: bytes
    pull: bool = False  # also a timed download (this peer's download capacity)
    asked: bool = False  # a link asked for: no big-probe spacing


class MeasurePlanner:
    """What to measure next (`next_job`; see the module doc). `next_target` is the all-pairs
    order: never-measured peers first, then the stalest past the re-measure interval."""

    def __init__(self, remeasure_s: float, bulk_interval_s: float, jitter: float,
                 rng: random.Random, *, full_mesh_max_peers: int = 1 << 30, capacity_peers: int = 3,
                 coord_interval_s: float = 1.0, confirm_fresh_s: float = 120.0,
                 max_report_links: int = 64) -> None:
        self.remeasure_s = remeasure_s
        self.bulk_interval_s = bulk_interval_s
        self.jitter = jitter
        self.full_mesh_max_peers = full_mesh_max_peers
        self.capacity_peers = capacity_peers
        self.coord_interval_s = coord_interval_s
        self.confirm_fresh_s = confirm_fresh_s
        self.max_report_links = max_report_links
        self._rng = rng
        self.links: dict[bytes, _Link] = {}
        self.next_bulk_at = 0.0
        self.next_coord_at = 0.0
        self.version = 0  # bumped when a figure a report carries changes
        self.asked: dict[bytes, float] = {}  # links asked for and not measured since: when asked
        self.coord_jobs = 0  # coordinate samples handed out

    def full_mesh(self, n_others: int) -> bool:
        return n_others <= self.full_mesh_max_peers

    def next_target(self, candidates: Iterable[bytes], now: float) -> bytes | None:
        fresh = [p for p in candidates if self.links.get(p, _Link()).bandwidth_gbps <= 0
                 or now - self.links[p].measured_at >= self.remeasure_s]
        if not fresh:
            return None
        never = [p for p in fresh if p not in self.links]
        if never:
            return self._rng.choice(never)
        return min(fresh, key=lambda p: self.links[p].measured_at)

    def ask(self, targets: Iterable[bytes], now: float) -> list[bytes]:
        """Queue the links to `targets` for measurement (a plan's links to confirm); those
        measured within confirm_fresh_s are not measured again. The targets queued."""
        queued = []
        for t in targets:
            link = self.links.get(t)
            if link is not None:
                link.asked_at = now
                if link.bandwidth_gbps > 0 and now - link.bandwidth_at < self.confirm_fresh_s:
                    continue
            else:
                self.links[t] = _Link(asked_at=now)
            self.asked.setdefault(t, now)
            queued.append(t)
        self.version += 1
        return queued

    def pending(self, targets: Iterable[bytes]) -> bool:
        """Whether any of `targets` is still queued by `ask`."""
        return any(t in self.asked for t in targets)

    def next_job(self, candidates: Sequence[bytes], now: float) -> MeasureJob | None:
        """The next measurement to make among `candidates` (the live peers but this one, in
        an order of the caller's: random choices are made in it)."""
        if self.asked:
            live = set(candidates)
            for t in [t for t, at in self.asked.items() if t not in live or now - at > self.confirm_fresh_s]:
                del self.asked[t]  # gone, or not measurable for that long: nothing to confirm
        if self.asked:
            first = min(self.asked, key=self.asked.__getitem__)
            return MeasureJob(JobKind.LINK, first, pull=self._downloads(now) < self.capacity_peers, asked=True)
        if now >= self.next_bulk_at and candidates:
            if self.full_mesh(len(candidates)):
                target = self.next_target(candidates, now)
            else:
                target = self._capacity_target(candidates, now)
            if target is not None:
                return MeasureJob(JobKind.LINK, target, pull=self._downloads(now) < self.capacity_peers)
            self.next_bulk_at = now + self.bulk_interval_s  # nothing to measure: look again then
        if now >= self.next_coord_at and candidates:
            # a quick start: the first FAST_COORD_JOBS samples four times as often
            interval = self.coord_interval_s / (4.0 if self.coord_jobs < FAST_COORD_JOBS else 1.0)
            self.next_coord_at = now + interval * self._rng.uniform(1 - self.jitter, 1 + self.jitter)
            self.coord_jobs += 1
            return MeasureJob(JobKind.COORD, self._rng.choice(candidates))
        return None

    def bulk_wait_s(self, now: float) -> float:
        return max(0.0, self.next_bulk_at - now)

    def wake_at(self, now: float) -> float:
        """When next_job, having just found nothing to do, may have work (asked links aside)."""
        at = min(self.next_bulk_at, self.next_coord_at)
        return at if at > now else now + min(self.coord_interval_s, self.bulk_interval_s)

    def _downloads(self, now: float) -> int:
        return sum(1 for link in self.links.values()
                   if link.download_gbps > 0 and now - link.download_at < self.remeasure_s)

    def _capacity_target(self, candidates: Sequence[bytes], now: float) -> bytes | None:
        """A peer to measure a link to, while fewer than capacity_peers links are fresh."""
        fresh = [p for p in candidates if self.links.get(p, _Link()).bandwidth_gbps > 0
                 and now - self.links[p].bandwidth_at < self.remeasure_s]
        if len(fresh) >= self.capacity_peers:
            return None
        tried = {p for p, link in self.links.items() if now - link.measured_at < self.remeasure_s}
        others = [p for p in candidates if p not in tried]
        return self._rng.choice(others) if others else None

    def record(self, target: bytes, rtts_s: list[float], gbps: float | None, now: float,
               download_gbps: float | None = None) -> None:
        link = self.links.setdefault(target, _Link())
        if rtts_s:
            link.rtt_ms = min(MAX_RTT_MS, max(1e-6, statistics.median(rtts_s) * 1000.0))
            link.samples = len(rtts_s)
        if gbps is not None:
            link.bandwidth_gbps = gbps
            link.bandwidth_at = now
            j = self.jitter
            self.next_bulk_at = now + self.bulk_interval_s * self._rng.uniform(1 - j, 1 + j)
        if download_gbps is not None:
            link.download_gbps = download_gbps
            link.download_at = now
        link.measured_at = now
        if gbps is not None or not rtts_s or target not in self.asked:
            self.asked.pop(target, None)  # measured, or unreachable: an answer either way
        self.version += 1

    def forget(self, peer_id: bytes) -> None:
        self.asked.pop(peer_id, None)
        if self.links.pop(peer_id, None) is not None:
            self.version += 1

    def capacity(self, now: float) -> tuple[float, float]:
        """This peer's upload and download capacity, Gbps: the best of its fresh timed
        uploads and downloads (0: none yet)."""
        fresh = [link for link in self.links.values() if now - link.bandwidth_at < self.remeasure_s]
        up = max((link.bandwidth_gbps for link in fresh if link.bandwidth_gbps > 0), default=0.0)
        down = max((link.download_gbps for link in self.links.values()
                    if link.download_gbps > 0 and now - link.download_at < self.remeasure_s), default=0.0)
        return up, down

    def entries(self, now: float | None = None) -> list[Entry]:
        """The links a report carries: those asked for within confirm_fresh_s, then the most
        recently measured with a bandwidth, at most max_report_links; without `now`, every
        link with a round trip (this peer's own measurements, for its status)."""
        if now is None:
            return [Entry(p, link.rtt_ms, link.bandwidth_gbps, link.samples)
                    for p, link in self.links.items() if link.rtt_ms is not None]
        measured = [(p, link.rtt_ms, link) for p, link in self.links.items()
                    if link.rtt_ms is not None and link.bandwidth_gbps > 0]
        measured.sort(key=lambda x: (now - x[2].asked_at >= self.confirm_fresh_s, -x[2].bandwidth_at))
        return [Entry(p, rtt_ms, link.bandwidth_gbps, link.samples, max(0.0, now - link.bandwidth_at))
                for p, rtt_ms, link in measured[:self.max_report_links]]


def report_due(config: GossipConfig, planner: MeasurePlanner, *, now: float, n_live: int,
               coord: Coordinate | None, rtt_scale_ms: float, last: Report | None, last_at: float,
               last_version: int, force: bool = False) -> bool:
    """Whether a peer signs a new report now (see docs/gossip.md, "Measurement at scale"): at
    once when it first becomes good to schedule with (a coordinate and both capacities), when
    its full-mesh row is complete, when `force`d (links asked for were measured) or when the
    last is `config.refresh_s()` old; otherwise when something it carries changed (the links, the
    coordinate by more than coord_republish_fraction x rtt_scale_ms, a capacity by more than
    capacity_republish_ratio), at most every publish_interval_s x max(1, N / 16): every report
    reaches every peer, so a large swarm re-publishes less often."""
    up, down = planner.capacity(now)
    stale = now - last_at >= config.refresh_s()
    if force or stale or last is None:
        return True
    ready = coord is not None and up > 0 and down > 0
    if ready and not (last.coord and last.up_gbps > 0 and last.down_gbps > 0):
        return True
    if planner.full_mesh(n_live - 1) and planner.version != last_version:
        if sum(1 for e in planner.entries(now) if e.bandwidth_gbps > 0) >= n_live - 1:
            return True
    if now - last_at < config.publish_interval_s * max(1.0, n_live / 16):
        return False
    if planner.version != last_version:
        return True
    if _capacity_ratio(last, up, down) > config.capacity_republish_ratio:
        return True
    if coord is None:
        return False
    before = Coordinate.from_wire(last.coord)
    if before is None:
        return True
    moved = math.dist(before.vec, coord.vec) + abs(before.height - coord.height)
    return moved > config.coord_republish_fraction * rtt_scale_ms


def _capacity_ratio(last: Report, up: float, down: float) -> float:
    """How far the capacities moved since `last` (a ratio >= 1; inf when newly known)."""
    worst = 1.0
    for a, b in ((last.up_gbps, up), (last.down_gbps, down)):
        if b <= 0:
            continue
        worst = max(worst, float("inf") if a <= 0 else max(a, b) / min(a, b))
    return worst


def compute_speed_ms(d_model: int = REFERENCE_BLOCK[0], n_heads: int = REFERENCE_BLOCK[1],
                     seq_len: int = REFERENCE_BLOCK[2], batch: int = REFERENCE_BLOCK[3],
                     repeats: int = PROBE_MIN_RUNS, seed: int = 0, min_s: float = PROBE_MIN_S) -> float:
    """Mean ms of forward+backward of one transformer block (CPU or the default device),
    over at least `repeats` runs and `min_s` seconds (`mean_ms`).

    Blocking: run it in a thread (trio.to_thread.run_sync).
    """
    block, x = reference_block(d_model, n_heads, seq_len, batch, seed)
    time_block_ms(block, x)  # (warms up)
    return mean_ms(lambda: time_block_ms(block, x), min_runs=repeats, min_s=min_s)


