"""Signed measurement reports, their acceptance rules and digests (exchanged by sync.py).

A report is one measurer's signed, compact account of itself and of the links it measured:
its network coordinate (`vivaldi.py`: the round trip to any peer is estimated from two
coordinates), its upload and download capacity (the best of its own timed transfers), its
compute speed and what coding (compression) costs on its CPU; and, for each link it measured
directly that is recent or was asked for (a bounded number, whatever the swarm's size), the
round-trip time (median of `samples` pings), the bandwidth of a timed transfer, and the age of
those figures. Signing one report per measurer rather than each (measurer, target) pair keeps
the work at N signatures and N verifications per peer instead of N^2.

Canonical encoding: msgpack of a fixed list, entries sorted by target id, floats as float64,
prefixed with a domain tag; the signature covers exactly those bytes.

The coding speed (`codec_ns`) is opaque here: empty (not measured) or `CODEC_NS_LEN` finite,
non-negative numbers below `MAX_CODEC_NS`, in the order of the scheduler's `CodecSpeed`
fields (nanoseconds per element: int8 encode and decode, int4 encode and decode, the Hadamard
rotation, sparse encode and decode); the control layer turns it into a `CodecSpeed`.

Verifying a signature is the one costly step (about 50 us); every cheaper refusal comes first,
and `RecordStore.offer_slices` verifies a batch in slices of `VERIFY_SLICE`, between which the
service yields to the other tasks (`offer_all`), so that a batch from the network never holds up
acks and pings.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtfm.net import PEER_ID_BYTES, ProtocolError, get_bytes, get_float, get_int, get_list, pack, verify_signature

from .messages import MAX_SEQ
from .vivaldi import COORD_DIMS, COORD_LEN

if TYPE_CHECKING:
    from dtfm.net import Identity

__all__ = ["Entry", "Report", "RecordStore", "digest_hash", "MAX_RTT_MS", "MAX_GBPS", "MAX_ENTRIES",
           "DIGEST_HASH_LEN", "VERIFY_SLICE", "CODEC_NS_LEN", "MAX_CODEC_NS", "check_codec_ns", "check_coord",
           "HOST_ID_LEN", "check_host",
           "BUCKETS", "BUCKET_HASH_LEN", "bucket_of"]

logger = logging.getLogger(__name__)

DOMAIN = b"dtfm-measure-v3\x00"  # v2: the coding-speed vector; v3: coordinate, capacities, link ages
MAX_RTT_MS = 60_000.0  # a minute: beyond any usable link
MAX_GBPS = 1_000.0  # beyond any real link between two peers
MAX_COMPUTE_MS = 3_600_000.0
CODEC_NS_LEN = 7  # figures in a coding-speed vector (dtfm.sched.CODEC_SPEED_LEN; tested equal)
MAX_CODEC_NS = 1e6  # ns per element: a millisecond, a million times any CPU's
MAX_SAMPLES = 100_000
MAX_AGE_S = 2.0**32  # a link figure's age when signed
MAX_COORD_MS = MAX_RTT_MS  # a coordinate's figures (vector and height), ms
MAX_COORD_ERROR = 100.0
MAX_ENTRIES = 4096
MAX_TIMESTAMP = 2.0**40
SIGNATURE_LEN = 64
HOST_ID_LEN = 8  # a report's host fingerprint
DIGEST_HASH_LEN = 16
VERIFY_SLICE = 32  # signatures verified between two yields to the scheduler (about 2 ms)


@dataclass(frozen=True)
class Entry:
    target: bytes
    rtt_ms: float  # median round trip
    bandwidth_gbps: float  # 0: not measured yet
    samples: int  # pings behind rtt_ms
    age_s: float = 0.0  # how long before the report's timestamp the link was last measured

    def to_wire(self) -> list:
        return [self.target, float(self.rtt_ms), float(self.bandwidth_gbps), self.samples, float(self.age_s)]

    @classmethod
    def from_wire(cls, obj: object) -> "Entry":
        if not isinstance(obj, list) or len(obj) != 5:
            raise ProtocolError("entry: expected a list of 5 fields")
        d = dict(zip(("target", "rtt", "bw", "n", "age"), obj))
        rtt = get_float(d, "rtt", 0.0, MAX_RTT_MS)
        if rtt <= 0.0:
            raise ProtocolError("entry: round trip must be positive")
        return cls(get_bytes(d, "target", PEER_ID_BYTES, PEER_ID_BYTES), rtt,
                   get_float(d, "bw", 0.0, MAX_GBPS), get_int(d, "n", 1, MAX_SAMPLES),
                   get_float(d, "age", 0.0, MAX_AGE_S))


def check_codec_ns(values: object) -> tuple[float, ...]:
    """A coding-speed vector as a report carries it: empty, or `CODEC_NS_LEN` finite numbers
    in [0, MAX_CODEC_NS]; ProtocolError for anything else."""
    if not isinstance(values, (list, tuple)):
        raise ProtocolError(f"codec speed: expected a list, got {type(values).__name__}")
    if len(values) not in (0, CODEC_NS_LEN):
        raise ProtocolError(f"codec speed: expected 0 or {CODEC_NS_LEN} figures, got {len(values)}")
    return tuple(get_float({"codec_ns": v}, "codec_ns", 0.0, MAX_CODEC_NS) for v in values)


def check_host(value: object) -> bytes:
    """A report's host: b"" (unknown) or HOST_ID_LEN bytes; ProtocolError for anything else."""
    if not isinstance(value, bytes) or len(value) not in (0, HOST_ID_LEN):
        raise ProtocolError(f"host: expected empty or {HOST_ID_LEN} bytes")
    return value


def check_coord(values: object) -> tuple[float, ...]:
    """A network coordinate as a report carries it (`vivaldi.Coordinate.to_wire`): empty (none
    yet), or COORD_DIMS figures in [-MAX_COORD_MS, MAX_COORD_MS], a height in [0, MAX_COORD_MS]
    and an error in [0, MAX_COORD_ERROR]; ProtocolError for anything else."""
    if not isinstance(values, (list, tuple)):
        raise ProtocolError(f"coordinate: expected a list, got {type(values).__name__}")
    if len(values) not in (0, COORD_LEN):
        raise ProtocolError(f"coordinate: expected 0 or {COORD_LEN} figures, got {len(values)}")
    out = [get_float({"c": v}, "c", -MAX_COORD_MS, MAX_COORD_MS) for v in values[:COORD_DIMS]]
    if values:
        out.append(get_float({"h": values[COORD_DIMS]}, "h", 0.0, MAX_COORD_MS))
        out.append(get_float({"e": values[COORD_DIMS + 1]}, "e", 0.0, MAX_COORD_ERROR))
    return tuple(out)


@dataclass(frozen=True)
class Report:
    measurer: bytes
    seq: int
    timestamp: float  # wall-clock seconds (Unix) when signed
    compute_ms: float  # own forward+backward time of the reference block; 0: unknown
    entries: tuple[Entry, ...]  # links measured directly (see docs/gossip.md: which ones)
    signature: bytes = b""
    codec_ns: tuple[float, ...] = ()  # own coding speed, ns per element (see the module doc); (): unknown
    coord: tuple[float, ...] = ()  # own network coordinate (`vivaldi.Coordinate.to_wire`); (): none yet
    up_gbps: float = 0.0  # own upload capacity, the best of its timed transfers out; 0: unknown
    down_gbps: float = 0.0  # own download capacity, the best of its timed transfers in; 0: unknown
    # the machine the peer runs on (`HOST_ID_LEN` bytes, the same for every daemon of one
    # machine and boot, nothing else derivable from it); b"": unknown (an older peer's report)
    host: bytes = b""
    # the share of a core the peer's compute had when it measured `compute_ms` (the CPU time of
    # its stage's compute over the wall time, from its own training steps); 0: unknown (a start
    # probe, a figure given in the configuration, a GPU stage)
    compute_share: float = 0.0

    def _body(self) -> list:
        body = [self.measurer, self.seq, float(self.timestamp), float(self.compute_ms),
                [e.to_wire() for e in self.entries], [float(v) for v in self.codec_ns],
                [float(v) for v in self.coord], float(self.up_gbps), float(self.down_gbps)]
        if self.compute_share:  # (then the host too, b"" where unknown)
            return body + [self.host, float(self.compute_share)]
        return body + [self.host] if self.host else body  # (without a host: the bytes an older peer signs)

    def signing_bytes(self) -> bytes:
        return DOMAIN + pack(self._body())

    @classmethod
    def create(cls, identity: Identity, seq: int, timestamp: float, compute_ms: float,
               entries: Iterable[Entry], *, codec_ns: Sequence[float] = (), coord: Sequence[float] = (),
               up_gbps: float = 0.0, down_gbps: float = 0.0, host: bytes = b"",
               compute_share: float = 0.0) -> "Report":
        """A report signed by `identity`; ValueError for figures a peer would refuse."""
        try:
            codec = check_codec_ns(tuple(codec_ns))
            point = check_coord(tuple(coord))
            up = get_float({"up": float(up_gbps)}, "up", 0.0, MAX_GBPS)
            down = get_float({"down": float(down_gbps)}, "down", 0.0, MAX_GBPS)
            machine = check_host(host)
            share = get_float({"share": float(compute_share)}, "share", 0.0, 1.0)
        except ProtocolError as e:
            raise ValueError(str(e)) from None
        ordered = tuple(sorted(entries, key=lambda e: e.target))
        unsigned = cls(identity.peer_id, seq, timestamp, compute_ms, ordered, codec_ns=codec, coord=point,
                       up_gbps=up, down_gbps=down, host=machine, compute_share=share)
        return cls(identity.peer_id, seq, timestamp, compute_ms, ordered,
                   identity.sign(unsigned.signing_bytes()), codec, point, up, down, machine, share)

    def verify(self) -> bool:
        return verify_signature(self.measurer, self.signing_bytes(), self.signature)

    def to_wire(self) -> list:
        body = self._body()
        return body[:5] + [self.signature] + body[5:]

    @property
    def wire_size(self) -> int:
        """Upper bound of the packed size in bytes."""
        return 140 + 73 * len(self.entries) + 9 * (len(self.codec_ns) + len(self.coord)) + 2 + len(self.host) + 9

    @classmethod
    def from_wire(cls, obj: object) -> "Report":
        if not isinstance(obj, list) or len(obj) not in (10, 11, 12):
            raise ProtocolError("report: expected a list of 10 fields (11 with the host, 12 with the compute's "
                                "share of a core)")
        d = dict(zip(("measurer", "seq", "ts", "compute", "entries", "sig", "codec", "coord", "up", "down", "host",
                      "share"), obj))
        host, share = b"", 0.0
        if len(obj) == 11:
            host = get_bytes(d, "host", HOST_ID_LEN, HOST_ID_LEN)
        elif len(obj) == 12:
            host = check_host(d["host"])
            share = get_float(d, "share", 0.0, 1.0)
            if not share > 0:
                raise ProtocolError("report: the compute's share of a core must be in (0, 1]")
        measurer = get_bytes(d, "measurer", PEER_ID_BYTES, PEER_ID_BYTES)
        entries = tuple(Entry.from_wire(x) for x in get_list(d, "entries", MAX_ENTRIES))
        targets = [e.target for e in entries]
        if targets != sorted(set(targets)):
            raise ProtocolError("report: entries not sorted by target or duplicated")
        if measurer in targets:
            raise ProtocolError("report: measurer measured itself")
        return cls(measurer, get_int(d, "seq", 0, MAX_SEQ), get_float(d, "ts", 0.0, MAX_TIMESTAMP),
                   get_float(d, "compute", 0.0, MAX_COMPUTE_MS), entries,
                   get_bytes(d, "sig", SIGNATURE_LEN, SIGNATURE_LEN), check_codec_ns(d["codec"]),
                   check_coord(d["coord"]), get_float(d, "up", 0.0, MAX_GBPS), get_float(d, "down", 0.0, MAX_GBPS),
                   host, share)


BUCKETS = 128  # a digest's buckets, by the measurer id's first byte (ids are public keys: uniform)
BUCKET_HASH_LEN = 8


def bucket_of(measurer: bytes) -> int:
    return measurer[0] * BUCKETS // 256


def digest_hash(digest: Iterable[tuple[bytes, int]]) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_HASH_LEN, person=b"dtfm-digest")
    for m, seq in sorted(digest):
        h.update(m)
        h.update(seq.to_bytes(8, "big"))
    return h.digest()


class RecordStore:
    """The newest accepted report of each measurer."""

    def __init__(self, skew_s: float, verify: Callable[[Report], bool] = Report.verify) -> None:
        self.skew_s = skew_s
        self._verify = verify
        self.reports: dict[bytes, Report] = {}
        self._floor: dict[bytes, int] = {}  # retired measurers: refuse seq <= this
        self.version = 0  # bumped on every change, for cached views
        self._hash = b""
        self._hash_version = -1
        self._buckets = b""
        self._buckets_version = -1
        self._dirty: set[int] = set()  # buckets changed since _buckets was computed
        self._dirty_since = -2  # the version the dirty set leads up to (tracking while it equals version)

    def offer(self, r: Report, *, now_wall: float, is_member: Callable[[bytes], bool]) -> str | None:
        """Accept a report; None if accepted, else the reason it was refused."""
        reason = self.screen(r, now_wall=now_wall, is_member=is_member)
        if reason is None and not self._verify(r):
            reason = "bad signature"
        if reason is not None:
            logger.debug("report %d from %s refused: %s", r.seq, r.measurer[:4].hex(), reason)
            return reason
        self.reports[r.measurer] = r
        self._changed(r.measurer)
        return None

    def offer_slices(self, reports: Iterable[Report], *, now_wall: float, is_member: Callable[[bytes], bool],
                     slice_size: int = VERIFY_SLICE) -> Generator[None, None, list[str | None]]:
        """Offer each report (see `offer`), pausing (a bare `yield`) after every `slice_size`
        signature verifications when reports remain, so that the caller lets other tasks run
        between two slices (gossip/service.py's `offer_all`); returns the reasons, one per
        report. Each report is screened again when its turn comes."""
        reasons: list[str | None] = []
        verified = 0
        for r in reports:
            if verified >= slice_size:
                yield
                verified = 0
            if self.screen(r, now_wall=now_wall, is_member=is_member) is None:
                verified += 1
            reasons.append(self.offer(r, now_wall=now_wall, is_member=is_member))
        return reasons

    def is_newer(self, measurer: bytes, seq: int) -> bool:
        """Whether a report (measurer, seq) could still be accepted: above what we hold and
        above the floor of a retired measurer. Costs no signature check."""
        if seq <= self._floor.get(measurer, -1):
            return False
        old = self.reports.get(measurer)
        return old is None or seq > old.seq

    def screen(self, r: Report, *, now_wall: float, is_member: Callable[[bytes], bool]) -> str | None:
        """Every refusal but the signature's, cheapest first: the reason, or None."""
        if r.seq <= self._floor.get(r.measurer, -1):
            return "measurer retired (dead) at a newer sequence number"
        if not is_member(r.measurer):
            return "measurer is not a live member"
        old = self.reports.get(r.measurer)
        if old is not None and old.seq >= r.seq:
            return "not newer than the report held"
        if not math.isfinite(r.timestamp) or abs(r.timestamp - now_wall) > self.skew_s:
            return "timestamp outside the skew window"
        return None

    def retire(self, peer_id: bytes) -> None:
        """A measurer died or left: drop its report and refuse its old ones."""
        old = self.reports.pop(peer_id, None)
        floor = old.seq if old is not None else -1
        self._floor[peer_id] = max(self._floor.get(peer_id, -1), floor)
        self._changed(peer_id)

    def digest(self) -> tuple[tuple[bytes, int], ...]:
        return tuple((m, r.seq) for m, r in self.reports.items())

    def digest_hash(self) -> bytes:
        """A hash of the digest: of its bucket hashes, so that a change re-hashes one bucket."""
        if self._hash_version != self.version:
            self._hash = hashlib.blake2b(self.bucket_hashes(), digest_size=DIGEST_HASH_LEN,
                                         person=b"dtfm-digest").digest()
            self._hash_version = self.version
        return self._hash

    def bucket_hashes(self) -> bytes:
        """BUCKETS hashes of BUCKET_HASH_LEN bytes, one per bucket of the digest: two stores
        that differ in a few reports differ in a few buckets (what sync.py's scoped exchange
        sends instead of the whole digest). Only the buckets changed since are hashed again."""
        if self._buckets_version != self.version:
            if self._dirty_since != self.version or not self._buckets:
                dirty = set(range(BUCKETS))
            else:
                dirty = self._dirty
            groups: dict[int, list[tuple[bytes, int]]] = {b: [] for b in dirty}
            for m, r in self.reports.items():
                g = groups.get(bucket_of(m))
                if g is not None:
                    g.append((m, r.seq))
            out = bytearray(self._buckets or bytes(BUCKETS * BUCKET_HASH_LEN))
            for b, g in groups.items():
                h = hashlib.blake2b(digest_size=BUCKET_HASH_LEN, person=b"dtfm-bucket")
                for m, seq in sorted(g):
                    h.update(m)
                    h.update(seq.to_bytes(8, "big"))
                out[b * BUCKET_HASH_LEN:(b + 1) * BUCKET_HASH_LEN] = h.digest()
            self._buckets = bytes(out)
            self._buckets_version = self._dirty_since = self.version
            self._dirty = set()
        return self._buckets

    def _changed(self, measurer: bytes) -> None:
        """A report of measurer was stored or dropped."""
        if self._dirty_since == self.version:  # the buckets were current: track what changes
            self._dirty.add(bucket_of(measurer))
            self._dirty_since += 1
        self.version += 1

    def digest_of(self, scope: Iterable[int]) -> tuple[tuple[bytes, int], ...]:
        """The digest's entries in the buckets of `scope`."""
        wanted = set(scope)
        return tuple((m, r.seq) for m, r in self.reports.items() if bucket_of(m) in wanted)

    def newer_than(self, digest: Iterable[tuple[bytes, int]], max_bytes: int,
                   scope: Iterable[int] | None = None) -> tuple[Report, ...]:
        """Reports we hold that the digest's owner lacks, within a byte budget; with `scope`
        (bucket indexes), the digest covers those buckets only, and so does the answer."""
        theirs = dict(digest)
        wanted = None if scope is None else set(scope)
        out: list[Report] = []
        used = 0
        for m, r in self.reports.items():
            if wanted is not None and bucket_of(m) not in wanted:
                continue
            if r.seq > theirs.get(m, -1):
                if out and used + r.wire_size > max_bytes:
                    break
                used += r.wire_size
                out.append(r)
        return tuple(out)
