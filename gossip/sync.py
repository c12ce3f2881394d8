"""Anti-entropy of signed measurement reports, as a sans-IO state machine.

One exchange between an initiator A and a responder B is up to four messages, each a
`RecordSync` whose step (`SyncStep`, the wire's `phase` field) names it:

    HASH     A -> B   a 16-byte hash of A's digest {measurer: seq}; B stops when its own is equal
    DIGEST   B -> A   B's digest
    OFFER    A -> B   A's digest and the reports B lacks
    REPORTS  B -> A   the reports A lacks (not sent when there are none)

`RecordSyncer` keeps a session per (role, peer) and does no I/O and reads no clock: the caller
passes `now`, sends the HASH that `start()` returns, feeds every received message to
`handle(src, msg, now)`, offers the reports of the returned `SyncActions` to the store and sends
their reply back to `src`. Two peers may each run a round with the other at once: HASH and
OFFER go to the responder's session, DIGEST and REPORTS to the initiator's.

    role       phase         input             next phase    emits
    initiator  any           start()           HASH_SENT     HASH
    initiator  HASH_SENT     DIGEST            OFFER_SENT    OFFER
    initiator  OFFER_SENT    REPORTS           IDLE          (accepts the reports)
    initiator  HASH_SENT     REPORTS           HASH_SENT     (accepts them: the answer to the
                                                             round this one replaced)
    responder  any           HASH, equal       IDLE          -
    responder  any           HASH, differs     DIGEST_SENT   DIGEST
    responder  DIGEST_SENT   OFFER             IDLE          REPORTS, if B holds any A lacks
                                                             (and accepts the offered reports)

Scoped exchange: a responder holding more than `SCOPED_DIGEST_MIN` reports answers a HASH with
its `BUCKETS` bucket hashes (the digest split by the measurer id's first byte) instead of its
digest; the initiator's OFFER then carries its digest entries of the buckets that differ (its
`scope`) and no reports, and the REPORTS answer holds the responder's newer reports of those
buckets. The initiator only pulls in such a round (it pushes nothing it does not know the
responder lacks; the responder pulls it in its own rounds), and the bytes of a round grow with
the number of reports that differ, not with the swarm: at 1,000 peers the whole digest is
about 42 KB, the bucket hashes 1 KB.

Any other (phase, input) pair leaves the phase as it is and emits nothing: the messages are
droppable datagrams, so a reply arriving after its session timed out or was replaced is normal,
not a protocol error. A session that sees no transition for `timeout_s` is back to IDLE.
Malformed messages fail in `RecordSync.from_wire` with `ProtocolError`.

The reports a message carries are trimmed before they reach `accept` (`SyncLimits`): of each
measurer only the newest, only those newer than the store holds, at most
`max_reports_per_message`, and no more than the sender's budget of
`reports_per_source_per_s` allows (a token bucket per sender holding up to `burst_reports`).
So a message of 4,096 copies of one report costs one signature check, and a flood costs at
most the cap; what is trimmed away arrives again in a later round.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from dtfm.net import PEER_ID_BYTES, ProtocolError, get_bytes, get_int, get_list

from .messages import MAX_SEQ, MsgType
from .records import BUCKET_HASH_LEN, BUCKETS, DIGEST_HASH_LEN, MAX_ENTRIES, RecordStore, Report, bucket_of

__all__ = ["RecordSync", "RecordSyncer", "SyncActions", "SyncLimits", "SyncPhase", "SyncRole", "SyncStep",
           "VerifyBudget", "MAX_SESSIONS"]

logger = logging.getLogger(__name__)

MAX_SESSIONS = 4096  # responder sessions at once (one per peer that sent a HASH); more are refused
# A responder holding more reports than this answers a HASH with its bucket hashes rather
# than its whole digest (a scoped exchange: see the module doc).
SCOPED_DIGEST_MIN = 24
MAX_BUCKETS = 1024  # senders whose verification budget is remembered while it refills


@dataclass(frozen=True)
class SyncLimits:
    """How many received reports go on to a signature check (about 50 us each)."""

    # Per message. An honest message carries one report per measurer within max_sync_bytes
    # (at most about 64 at the default 256 KiB); a flood of 4,096 would cost 0.2 s.
    max_reports_per_message: int = 256
    # Per sender, refilling continuously: an honest peer sends us a few report-carrying
    # messages per sync interval. Lower bounds the CPU one member can spend of ours (256/s is
    # about 1.3% of a core); higher lets a burst of new rows in faster.
    reports_per_source_per_s: float = 256.0
    # The bucket's size: what one sender may spend at once after being quiet.
    burst_reports: int = 512

    def __post_init__(self) -> None:
        if self.max_reports_per_message < 1 or self.burst_reports < 1:
            raise ValueError("max_reports_per_message and burst_reports must be >= 1")
        if not self.reports_per_source_per_s > 0:
            raise ValueError("reports_per_source_per_s must be positive")


class VerifyBudget:
    """A token bucket per sender: how many of its reports may still be verified now."""

    def __init__(self, rate_per_s: float, burst: int, max_buckets: int = MAX_BUCKETS) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_buckets = max_buckets
        self._buckets: dict[bytes, tuple[float, float]] = {}  # sender: (tokens, at time)

    def available(self, src: bytes, now: float) -> float:
        tokens, at = self._buckets.get(src, (float(self.burst), now))
        return min(float(self.burst), tokens + max(0.0, now - at) * self.rate_per_s)

    def take(self, src: bytes, want: int, now: float) -> int:
        """Spend up to `want` tokens of src's; how many were granted."""
        granted = max(0, min(want, int(self.available(src, now))))
        self._buckets[src] = (self.available(src, now) - granted, now)
        if len(self._buckets) > self.max_buckets:  # a full bucket is the same as none
            for p in [p for p in self._buckets if self.available(p, now) >= self.burst]:
                del self._buckets[p]
        return granted


class SyncStep(enum.IntEnum):
    """Which message of the exchange; the numbers are on the wire."""

    HASH = 0
    DIGEST = 1
    OFFER = 2
    REPORTS = 3


# step: (hash length, may carry a digest, may carry reports)
_SHAPE = {
    SyncStep.HASH: (DIGEST_HASH_LEN, False, False),
    SyncStep.DIGEST: (0, True, False),
    SyncStep.OFFER: (0, True, True),
    SyncStep.REPORTS: (0, False, True),
}


@dataclass(frozen=True)
class RecordSync:
    """One message of the anti-entropy exchange."""

    step: SyncStep
    digest_hash: bytes  # HASH only
    digest: tuple[tuple[bytes, int], ...]  # (measurer, seq); DIGEST and OFFER only
    reports: tuple[Report, ...]  # OFFER and REPORTS only
    buckets: bytes = b""  # DIGEST only, instead of the digest: BUCKETS bucket hashes
    scope: tuple[int, ...] = ()  # OFFER only: the buckets its digest covers (empty: all of it)
    type = MsgType.RECORD_SYNC

    def to_wire(self) -> dict:
        out = {"phase": int(self.step), "hash": self.digest_hash,
               "digest": [[m, s] for m, s in self.digest],
               "reports": [r.to_wire() for r in self.reports]}
        if self.buckets:
            out["buckets"] = self.buckets
        if self.scope:
            out["scope"] = list(self.scope)
        return out

    @classmethod
    def from_wire(cls, body: object) -> "RecordSync":
        if not isinstance(body, dict):
            raise ProtocolError("record sync: expected a map")
        step = SyncStep(get_int(body, "phase", 0, len(SyncStep) - 1))
        digest_hash = get_bytes(body, "hash", 0, DIGEST_HASH_LEN)
        digest = _digest_from_wire(get_list(body, "digest", MAX_ENTRIES))
        reports = tuple(Report.from_wire(x) for x in get_list(body, "reports", MAX_ENTRIES))
        hash_len, with_digest, with_reports = _SHAPE[step]
        if len(digest_hash) != hash_len:
            raise ProtocolError(f"record sync {step.name}: hash of {len(digest_hash)} bytes, expected {hash_len}")
        if digest and not with_digest:
            raise ProtocolError(f"record sync {step.name}: carries a digest")
        if reports and not with_reports:
            raise ProtocolError(f"record sync {step.name}: carries reports")
        buckets = get_bytes(body, "buckets", 0, BUCKETS * BUCKET_HASH_LEN) if "buckets" in body else b""
        if buckets and (len(buckets) != BUCKETS * BUCKET_HASH_LEN or step is not SyncStep.DIGEST or digest):
            raise ProtocolError(f"record sync {step.name}: bucket hashes out of place or of the wrong length")
        raw_scope = get_list(body, "scope", BUCKETS) if "scope" in body else []
        scope = tuple(get_int({"b": b}, "b", 0, BUCKETS - 1) for b in raw_scope)
        if scope and (step is not SyncStep.OFFER or len(set(scope)) != len(scope)):
            raise ProtocolError(f"record sync {step.name}: a scope out of place or listing a bucket twice")
        if scope and any(bucket_of(m) not in set(scope) for m, _ in digest):
            raise ProtocolError("record sync OFFER: a digest entry outside its scope")
        return cls(step, digest_hash, digest, reports, buckets, scope)


def _digest_from_wire(items: list) -> tuple[tuple[bytes, int], ...]:
    digest = []
    for item in items:
        if not isinstance(item, list) or len(item) != 2:
            raise ProtocolError("digest item: expected [measurer, seq]")
        d = {"m": item[0], "s": item[1]}
        digest.append((get_bytes(d, "m", PEER_ID_BYTES, PEER_ID_BYTES), get_int(d, "s", 0, MAX_SEQ)))
    if len({m for m, _ in digest}) != len(digest):
        raise ProtocolError("digest: a measurer listed twice")
    return tuple(digest)


class SyncRole(enum.Enum):
    INITIATOR = "initiator"  # sent the HASH
    RESPONDER = "responder"  # received it


class SyncPhase(enum.Enum):
    IDLE = "idle"
    HASH_SENT = "hash sent"  # initiator: waits for the responder's DIGEST
    OFFER_SENT = "offer sent"  # initiator: waits for the REPORTS it lacks
    DIGEST_SENT = "digest sent"  # responder: waits for the OFFER


_ROLE = {SyncStep.HASH: SyncRole.RESPONDER, SyncStep.DIGEST: SyncRole.INITIATOR,
         SyncStep.OFFER: SyncRole.RESPONDER, SyncStep.REPORTS: SyncRole.INITIATOR}


@dataclass(frozen=True)
class SyncActions:
    """What the caller does after `handle`: offer `accept` to the store, then send `reply`."""

    accept: tuple[Report, ...] = ()
    reply: RecordSync | None = None


_NOTHING = SyncActions()


@dataclass(frozen=True)
class _Session:
    phase: SyncPhase
    expires_at: float


class RecordSyncer:
    """Sessions of the exchange with each peer, over one `RecordStore` it reads but never
    changes (the caller offers the reports it is handed).

    Initiator sessions are made by `start()`, one per sync round, and expire; responder
    sessions are made by peers' HASHes, at most `max_sessions` at once.
    """

    def __init__(self, store: RecordStore, *, max_sync_bytes: int, timeout_s: float,
                 max_sessions: int = MAX_SESSIONS, limits: SyncLimits = SyncLimits()) -> None:
        if timeout_s <= 0 or max_sync_bytes < 1 or max_sessions < 1:
            raise ValueError("need timeout_s > 0, max_sync_bytes >= 1 and max_sessions >= 1")
        self.store = store
        self.max_sync_bytes = max_sync_bytes
        self.timeout_s = timeout_s
        self.max_sessions = max_sessions
        self.limits = limits
        self.budget = VerifyBudget(limits.reports_per_source_per_s, limits.burst_reports)
        self._sessions: dict[SyncRole, dict[bytes, _Session]] = {r: {} for r in SyncRole}

    def phase(self, peer_id: bytes, role: SyncRole) -> SyncPhase:
        s = self._sessions[role].get(peer_id)
        return SyncPhase.IDLE if s is None else s.phase

    def start(self, peer_id: bytes, now: float) -> RecordSync:
        """Begin a round with peer_id (replacing one in progress): the HASH to send it."""
        self._enter(SyncRole.INITIATOR, peer_id, SyncPhase.HASH_SENT, now)
        return RecordSync(SyncStep.HASH, self.store.digest_hash(), (), ())

    def tick(self, now: float) -> None:
        """Sessions past their timeout go back to IDLE."""
        for role, sessions in self._sessions.items():
            for peer_id in [p for p, s in sessions.items() if now >= s.expires_at]:
                self._expire(role, peer_id)

    def handle(self, src: bytes, msg: RecordSync, now: float) -> SyncActions:
        role = _ROLE[msg.step]
        phase = self._current(role, src, now)
        if msg.step is SyncStep.HASH:  # a new round, in any phase
            if msg.digest_hash == self.store.digest_hash():
                self._enter(role, src, SyncPhase.IDLE, now)
                return _NOTHING
            if not self._enter(role, src, SyncPhase.DIGEST_SENT, now):
                return _NOTHING
            if len(self.store.reports) > SCOPED_DIGEST_MIN:
                return SyncActions(reply=RecordSync(SyncStep.DIGEST, b"", (), (), self.store.bucket_hashes()))
            return SyncActions(reply=RecordSync(SyncStep.DIGEST, b"", self.store.digest(), ()))
        if msg.step is SyncStep.DIGEST and phase is SyncPhase.HASH_SENT:
            self._enter(role, src, SyncPhase.OFFER_SENT, now)
            if msg.buckets:  # scoped: our entries in the buckets that differ, to pull theirs
                mine = self.store.bucket_hashes()
                w = BUCKET_HASH_LEN
                scope = tuple(b for b in range(BUCKETS) if mine[b * w:(b + 1) * w] != msg.buckets[b * w:(b + 1) * w])
                if not scope:
                    self._enter(role, src, SyncPhase.IDLE, now)
                    return _NOTHING
                return SyncActions(reply=RecordSync(SyncStep.OFFER, b"", self.store.digest_of(scope), (),
                                                    scope=scope))
            offer = RecordSync(SyncStep.OFFER, b"", self.store.digest(), self._newer(msg.digest))
            return SyncActions(reply=offer)
        if msg.step is SyncStep.OFFER and phase is SyncPhase.DIGEST_SENT:
            self._enter(role, src, SyncPhase.IDLE, now)
            # Computed before the offered reports are accepted: those are covered by the
            # offer's own digest, so accepting them first would not change it.
            newer = self._newer(msg.digest, msg.scope or None)
            reply = RecordSync(SyncStep.REPORTS, b"", (), newer) if newer else None
            return SyncActions(self._admit(src, msg.reports, now), reply)
        if msg.step is SyncStep.REPORTS and phase is SyncPhase.OFFER_SENT:
            self._enter(role, src, SyncPhase.IDLE, now)
            return SyncActions(accept=self._admit(src, msg.reports, now))
        if msg.step is SyncStep.REPORTS and phase is SyncPhase.HASH_SENT:
            # late, from the round start() replaced
            return SyncActions(accept=self._admit(src, msg.reports, now))
        logger.debug("record sync %s from %s unexpected in phase %s (%s): dropped", msg.step.name,
                     src[:4].hex(), phase.value, role.value)
        return _NOTHING

    def _admit(self, src: bytes, reports: tuple[Report, ...], now: float) -> tuple[Report, ...]:
        """The reports of a message worth a signature check, within the limits."""
        newest: dict[bytes, Report] = {}
        for r in reports:
            held = newest.get(r.measurer)
            if held is None or r.seq > held.seq:
                newest[r.measurer] = r
        fresh = [r for r in newest.values() if self.store.is_newer(r.measurer, r.seq)]
        cap = self.limits.max_reports_per_message
        if len(fresh) > cap:
            logger.warning("record sync from %s: %d new reports in one message, dropped all but %d",
                           src[:4].hex(), len(fresh), cap)
            fresh = fresh[:cap]
        granted = self.budget.take(src, len(fresh), now)
        if granted < len(fresh):
            logger.warning("record sync from %s: over its verification budget, dropped %d reports",
                           src[:4].hex(), len(fresh) - granted)
        return tuple(fresh[:granted])

    def _newer(self, digest: Iterable[tuple[bytes, int]], scope: Iterable[int] | None = None) -> tuple[Report, ...]:
        return self.store.newer_than(digest, self.max_sync_bytes, scope)

    def _current(self, role: SyncRole, peer_id: bytes, now: float) -> SyncPhase:
        sessions = self._sessions[role]
        s = sessions.get(peer_id)
        if s is None:
            return SyncPhase.IDLE
        if now >= s.expires_at:
            self._expire(role, peer_id)
            return SyncPhase.IDLE
        return s.phase

    def _expire(self, role: SyncRole, peer_id: bytes) -> None:
        s = self._sessions[role].pop(peer_id)
        logger.debug("record sync with %s (%s) timed out in phase %s", peer_id[:4].hex(), role.value, s.phase.value)

    def _enter(self, role: SyncRole, peer_id: bytes, phase: SyncPhase, now: float) -> bool:
        """Move a session to `phase`; False if it would be a new responder session over the cap."""
        sessions = self._sessions[role]
        if phase is SyncPhase.IDLE:
            sessions.pop(peer_id, None)
            return True
        if role is SyncRole.RESPONDER and peer_id not in sessions and len(sessions) >= self.max_sessions:
            self.tick(now)
            if len(sessions) >= self.max_sessions:
                logger.warning("record sync: %d sessions in progress, dropped a HASH from %s",
                               len(sessions), peer_id[:4].hex())
                return False
        sessions[peer_id] = _Session(phase, now + self.timeout_s)
        return True
