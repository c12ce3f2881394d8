"""Coordinator election, Raft-style, as a sans-IO state machine.

`ElectionState` does no I/O and reads no clock: the driver passes `now`, feeds received
messages to `handle(src, msg, now)`, calls `tick(now)` at `next_deadline()`, and executes the
returned actions *in order*: a `Persist` (write term and vote to disk, fsync, before anything
after it) always precedes the `ElectionSend` of the vote it records. A restarted node is built
from what its store loads (`ElectionStore.load`).

    role           event                                      next role      emits
    follower       election timer (see Timers)                pre-candidate  PreVote to the voters
    pre-candidate  pre-votes of a majority                    candidate      Persist(term+1, me), RequestVote
    candidate      votes of a majority                        coordinator    BecameCoordinator, Heartbeat
    coordinator    heartbeat timer                            coordinator    Heartbeat to the voters
    coordinator    acks from < a majority within lease_s      follower       SteppedDown (check-quorum)
    coordinator    ack with a higher term from a voter        candidate      Persist(t+1, me), RequestVote
    any            Heartbeat of a term >= its own             follower       Persist if newer, HeartbeatAck
    any            message of a higher term                   follower       Persist(t, None)

Votes. A voter grants one vote per term, persisted before it is sent, and only to a candidate
of its configuration (when it has one) whose last applied (term, epoch) is not older than its
own. A pre-vote changes nothing on the voter. While a voter has heard its coordinator within
`lease_s` it refuses pre-votes and votes for anyone else, without taking their term: a peer that
was cut off, even with an inflated term, cannot depose a coordinator a majority still hears.
The coordinator itself may stand again: if a voter answers its heartbeat with a higher term,
it stands in the term after that one at once (no pre-vote), and its followers grant it.

Timers. A follower stands after uniform(election_timeout_min_s, election_timeout_max_s) plus
rank * stagger_s without hearing its coordinator, its rank being its place in an order of the
voters every peer of the term computes alike (a hash of term and peer id, the coordinator
last): after a crash the first-ranked peer stands about one stagger before the next, so two
candidates rarely split a vote, even when the round trips are as long as the random spread.

Configuration. The voters are the peers of the last applied allocation (`set_voters`); a
follower also takes the coordinator's voters from a heartbeat whose applied (term, epoch) is
not older than its own. Until a node has voters it votes but never stands. `campaign(now)`
stands at once (`train start`).

Allocations. `may_apply(issuer, term, epoch)` refuses an allocation unless `issuer` is the
coordinator this node recognises for `term`, `term` is its current term, and (term, epoch) is
newer than the last applied; `applied(term, epoch)` records one. The applied (term, epoch) only
grows.

Time. A clock that goes backwards shifts every stored instant by the same amount, so
intervals keep their length; a jump forwards looks like elapsed time (timers fire early, which
costs an election at worst, never safety: safety rests on votes alone).
"""

from __future__ import annotations

import enum
import hashlib
import logging
import random
from dataclasses import dataclass

from dtfm.net import short_id

from ..allocation import Refusal
from .config import ElectionConfig
from .messages import (
    MAX_TERM,
    ElectionMessage,
    Heartbeat,
    HeartbeatAck,
    PreVote,
    PreVoteReply,
    RequestVote,
    Vote,
    check_voters,
)

__all__ = [
    "BecameCoordinator",
    "CoordinatorKnown",
    "ElectionAction",
    "ElectionRole",
    "ElectionSend",
    "ElectionState",
    "Persist",
    "SteppedDown",
]

logger = logging.getLogger(__name__)

_NEVER = float("inf")
_LONG_AGO = float("-inf")


class ElectionRole(enum.Enum):
    FOLLOWER = "follower"
    PRE_CANDIDATE = "pre-candidate"
    CANDIDATE = "candidate"
    COORDINATOR = "coordinator"


@dataclass(frozen=True)
class ElectionSend:
    to: bytes
    msg: ElectionMessage


@dataclass(frozen=True)
class Persist:
    """Write (term, voted_for) durably before executing any later action."""

    term: int
    voted_for: bytes | None


@dataclass(frozen=True)
class BecameCoordinator:
    term: int


@dataclass(frozen=True)
class CoordinatorKnown:
    """The coordinator this node recognises changed: `coordinator` of `term`, or None."""

    term: int
    coordinator: bytes | None


@dataclass(frozen=True)
class SteppedDown:
    term: int
    reason: str
    standing_again: bool = False  # a voter is ahead: it stands in a higher term at once


ElectionAction = ElectionSend | Persist | BecameCoordinator | CoordinatorKnown | SteppedDown


class ElectionState:
    def __init__(self, me: bytes, config: ElectionConfig, rng: random.Random, now: float, *, term: int = 0,
                 voted_for: bytes | None = None, voters: tuple[bytes, ...] | None = None,
                 applied: tuple[int, int] = (0, 0)) -> None:
        if not 0 <= term <= MAX_TERM:
            raise ValueError(f"term must be in [0, {MAX_TERM}], got {term}")
        self.me = me
        self.config = config
        self._rng = rng
        self.term = term
        self.voted_for = voted_for
        self.role = ElectionRole.FOLLOWER
        self.coordinator: bytes | None = None  # the coordinator of self.term, as known here
        self.voters: tuple[bytes, ...] = check_voters(voters) if voters is not None else ()
        applied_term, applied_epoch = applied
        self.last_applied: tuple[int, int] = (applied_term, applied_epoch)
        self._now = now
        self._rank_cache: tuple = (None, 0)
        self._heard_at = _LONG_AGO  # when the recognised coordinator was last heard
        self._deadline = now + self._timeout()  # election timer; pre-vote or vote round's end
        self._grants: set[bytes] = set()  # of the current pre-vote or vote round
        self._since = now  # coordinator since
        self._next_heartbeat = _NEVER
        self._seq = 0
        self._sent_at: dict[int, float] = {}  # heartbeat seq -> when it left (recent ones)
        self._acked_at: dict[bytes, float] = {}  # voter -> when the last heartbeat it acked left

    # ------------------------------------------------------------------ queries

    @property
    def majority(self) -> int:
        return len(self.voters) // 2 + 1

    def next_deadline(self) -> float:
        return self._next_heartbeat if self.role is ElectionRole.COORDINATOR else self._deadline

    def may_apply(self, issuer: bytes, term: int, epoch: int) -> Refusal | None:
        """None if an allocation of `issuer` at (term, epoch) may be applied here, else why not."""
        if term < self.term:
            return Refusal("stale", f"term {term} is older than this peer's term {self.term}")
        if term > self.term or self.coordinator is None:
            return Refusal("not-coordinator", f"this peer knows no coordinator of term {term} yet")
        if issuer != self.coordinator:
            return Refusal("not-coordinator", f"{short_id(issuer)} is not the coordinator of term {term} "
                                              f"({short_id(self.coordinator)} is)")
        if (term, epoch) <= self.last_applied:
            return Refusal("stale", f"term {term} epoch {epoch} is not newer than term {self.last_applied[0]} "
                                    f"epoch {self.last_applied[1]}, already applied")
        return None

    # ------------------------------------------------------------------ driver inputs

    def applied(self, term: int, epoch: int) -> None:
        """Record an allocation this node applied (after `may_apply` said yes)."""
        if (term, epoch) <= self.last_applied:
            raise ValueError(f"applied (term, epoch) only grows: ({term}, {epoch}) after {self.last_applied}")
        self.last_applied = (term, epoch)

    def set_voters(self, voters: tuple[bytes, ...], now: float) -> list[ElectionAction]:
        """The configuration of an applied allocation, or the first one (`train start`)."""
        self._advance(now)
        self.voters = check_voters(voters)
        out: list[ElectionAction] = []
        if self.role is ElectionRole.COORDINATOR and self.me not in self.voters:
            self._step_down(out, "not a voter of the new configuration")
        return out

    def campaign(self, now: float) -> list[ElectionAction]:
        """Stand now instead of at the election timer (`train start` on this peer)."""
        self._advance(now)
        out: list[ElectionAction] = []
        if self.role is ElectionRole.FOLLOWER:
            self._stand(out)
        return out

    def tick(self, now: float) -> list[ElectionAction]:
        self._advance(now)
        out: list[ElectionAction] = []
        if self.role is ElectionRole.COORDINATOR:
            if now >= self._next_heartbeat:
                if self.config.check_quorum and not self._quorum_heard():
                    self._step_down(out, f"no acks from a majority within {self.config.lease_s:g} s")
                else:
                    self._heartbeat(out)
        elif now >= self._deadline:
            self._stand(out)
        return out

    def handle(self, src: bytes, msg: ElectionMessage, now: float) -> list[ElectionAction]:
        self._advance(now)
        out: list[ElectionAction] = []
        if isinstance(msg, Heartbeat):
            self._on_heartbeat(src, msg, out)
        elif isinstance(msg, HeartbeatAck):
            self._on_ack(src, msg, out)
        elif isinstance(msg, PreVote):
            self._on_pre_vote(src, msg, out)
        elif isinstance(msg, PreVoteReply):
            self._on_pre_vote_reply(src, msg, out)
        elif isinstance(msg, RequestVote):
            self._on_request_vote(src, msg, out)
        elif isinstance(msg, Vote):
            self._on_vote(src, msg, out)
        return out

    # ------------------------------------------------------------------ time

    def _timeout(self) -> float:
        c = self.config
        return self._rng.uniform(c.election_timeout_min_s, c.election_timeout_max_s) + self._rank() * c.stagger_s

    def _rank(self) -> int:
        """This peer's place in the term's standing order: a hash of (term, peer), coordinator last."""
        if self.me not in self.voters or not self.config.stagger_s:
            return 0
        key = (self.term, self.coordinator, self.voters)
        if self._rank_cache[0] != key:
            term = self.term.to_bytes(8, "big")
            order = sorted(self.voters, key=lambda v: (v == self.coordinator,
                                                       hashlib.blake2b(term + v, digest_size=8).digest()))
            self._rank_cache = (key, order.index(self.me))
        return self._rank_cache[1]

    def _advance(self, now: float) -> None:
        shift = now - self._now
        if shift < 0:  # the clock went back: keep every interval's length
            self._deadline += shift
            self._heard_at += shift
            self._since += shift
            self._next_heartbeat += shift
            self._sent_at = {k: t + shift for k, t in self._sent_at.items()}
            self._acked_at = {k: t + shift for k, t in self._acked_at.items()}
        self._now = now

    def _in_lease(self) -> bool:
        """A coordinator, or a follower that heard its coordinator within lease_s."""
        if not self.config.pre_vote:
            return False
        if self.role is ElectionRole.COORDINATOR:
            return True
        return self.coordinator is not None and self._now - self._heard_at < self.config.lease_s

    # ------------------------------------------------------------------ standing

    def _stand(self, out: list[ElectionAction]) -> None:
        self._deadline = self._now + self._timeout()
        if self.me not in self.voters:
            self.role = ElectionRole.FOLLOWER
            return  # no configuration yet, or not a voter of it: never stands
        if self.config.pre_vote:
            self.role = ElectionRole.PRE_CANDIDATE
            self._grants = {self.me}
            msg = PreVote(self.term + 1, self.me, *self.last_applied)
            out.extend(ElectionSend(v, msg) for v in self.voters if v != self.me)
            self._check_pre_votes(out)
        else:
            self._become_candidate(self.term + 1, out)

    def _check_pre_votes(self, out: list[ElectionAction]) -> None:
        if len(self._grants & set(self.voters)) >= self.majority:
            self._become_candidate(self.term + 1, out)

    def _become_candidate(self, term: int, out: list[ElectionAction]) -> None:
        self._set_term(term, self.me, out)
        self.role = ElectionRole.CANDIDATE
        self._grants = {self.me}
        self._deadline = self._now + self._timeout()
        msg = RequestVote(self.term, self.me, *self.last_applied)
        out.extend(ElectionSend(v, msg) for v in self.voters if v != self.me)
        self._check_votes(out)

    def _check_votes(self, out: list[ElectionAction]) -> None:
        if self.role is ElectionRole.CANDIDATE and len(self._grants & set(self.voters)) >= self.majority:
            self.role = ElectionRole.COORDINATOR
            self._since = self._now
            self._acked_at = {}
            self._sent_at = {}
            out.append(BecameCoordinator(self.term))
            self._recognise(self.me, out)
            logger.info("coordinator of term %d with %d of %d votes", self.term, len(self._grants), len(self.voters))
            self._heartbeat(out)

    def _heartbeat(self, out: list[ElectionAction]) -> None:
        self._seq += 1
        self._sent_at[self._seq] = self._now
        keep = int(self.config.lease_s / self.config.heartbeat_interval_s) + 2
        self._sent_at.pop(self._seq - keep, None)
        self._next_heartbeat = self._now + self.config.heartbeat_interval_s
        msg = Heartbeat(self.term, self.me, self._seq, self.voters, *self.last_applied)
        out.extend(ElectionSend(v, msg) for v in self.voters if v != self.me)

    def _quorum_heard(self) -> bool:
        if self._now - self._since < self.config.lease_s:
            return True
        since = self._now - self.config.lease_s
        heard = sum(1 for v in self.voters if v == self.me or self._acked_at.get(v, _LONG_AGO) >= since)
        return heard >= self.majority

    def _step_down(self, out: list[ElectionAction], reason: str, standing_again: bool = False) -> None:
        self.role = ElectionRole.FOLLOWER
        self._next_heartbeat = _NEVER
        self._deadline = self._now + self._timeout()
        self._recognise(None, out)
        out.append(SteppedDown(self.term, reason, standing_again))
        logger.info("stepped down in term %d: %s", self.term, reason)

    # ------------------------------------------------------------------ terms

    def _set_term(self, term: int, voted_for: bytes | None, out: list[ElectionAction], persist: bool = True) -> None:
        if term != self.term:
            self.term = term
            self._recognise(None, out)
        self.voted_for = voted_for
        if persist:
            out.append(Persist(term, voted_for))

    def _adopt(self, term: int, out: list[ElectionAction], why: str, persist: bool = True) -> None:
        """Follow a higher term seen in a message (no vote in it yet)."""
        if self.role is ElectionRole.COORDINATOR:
            self._step_down(out, why)
        self.role = ElectionRole.FOLLOWER
        self._set_term(term, None, out, persist)

    def _recognise(self, coordinator: bytes | None, out: list[ElectionAction]) -> None:
        if coordinator != self.coordinator:
            self.coordinator = coordinator
            out.append(CoordinatorKnown(self.term, coordinator))

    # ------------------------------------------------------------------ messages

    def _on_heartbeat(self, src: bytes, m: Heartbeat, out: list[ElectionAction]) -> None:
        if m.coordinator != src:
            logger.debug("heartbeat from %s names coordinator %s: ignored", short_id(src), short_id(m.coordinator))
            return
        if m.term < self.term:
            out.append(ElectionSend(src, HeartbeatAck(self.term, m.seq, False, *self.last_applied)))
            return
        if m.term > self.term:
            self._adopt(m.term, out, f"heartbeat of term {m.term} from {short_id(src)}")
        if self.role is ElectionRole.COORDINATOR:  # a second coordinator in one term: impossible with one vote each
            logger.error("heartbeat of %s as coordinator of term %d, this peer's own term", short_id(src), m.term)
            return
        self.role = ElectionRole.FOLLOWER
        self._recognise(src, out)
        self._heard_at = self._now
        self._deadline = self._now + self._timeout()
        if (m.applied_term, m.applied_epoch) >= self.last_applied and m.voters != self.voters:
            self.voters = m.voters  # the coordinator knows the configuration at least as new as ours
        out.append(ElectionSend(src, HeartbeatAck(self.term, m.seq, True, *self.last_applied)))

    def _on_ack(self, src: bytes, m: HeartbeatAck, out: list[ElectionAction]) -> None:
        if self.role is not ElectionRole.COORDINATOR or src not in self.voters:
            return
        if m.term > self.term:
            if self.config.pre_vote:  # a voter ahead: stand again at once, above its term
                why = f"voter {short_id(src)} is in term {m.term}: standing in term {m.term + 1}"
                self._step_down(out, why, standing_again=True)
                self._become_candidate(m.term + 1, out)
            else:
                self._adopt(m.term, out, f"voter {short_id(src)} is in term {m.term}")
            return
        if m.term == self.term and m.ok and m.seq in self._sent_at:
            self._acked_at[src] = max(self._acked_at.get(src, _LONG_AGO), self._sent_at[m.seq])

    def _refuses_candidate(self, src: bytes, applied: tuple[int, int]) -> str | None:
        if self.voters and src not in self.voters:
            return "not a voter of this peer's configuration"
        if applied < self.last_applied:
            return f"its last applied {applied} is older than this peer's {self.last_applied}"
        return None

    def _on_pre_vote(self, src: bytes, m: PreVote, out: list[ElectionAction]) -> None:
        if m.candidate != src:
            return
        why = self._refuses_candidate(src, (m.applied_term, m.applied_epoch))
        if self._in_lease():
            why = "its coordinator is alive"
        elif m.term < self.term or (m.term == self.term and (self.voted_for not in (None, src) or self.coordinator)):
            why = f"term {m.term} is not newer than this peer's term {self.term}"
        if why:
            logger.debug("pre-vote for %s in term %d refused: %s", short_id(src), m.term, why)
        out.append(ElectionSend(src, PreVoteReply(m.term, why is None, self.term)))

    def _on_pre_vote_reply(self, src: bytes, m: PreVoteReply, out: list[ElectionAction]) -> None:
        if self.role is ElectionRole.COORDINATOR:
            return
        if m.voter_term > self.term:
            self._adopt(m.voter_term, out, f"pre-vote reply of term {m.voter_term}")
            return
        if self.role is ElectionRole.PRE_CANDIDATE and m.term == self.term + 1 and m.granted:
            self._grants.add(src)
            self._check_pre_votes(out)

    def _on_request_vote(self, src: bytes, m: RequestVote, out: list[ElectionAction]) -> None:
        if m.candidate != src:
            return
        if m.term < self.term:
            out.append(ElectionSend(src, Vote(self.term, False)))
            return
        if self._in_lease() and src != self.coordinator:
            logger.debug("vote for %s in term %d refused: its coordinator is alive", short_id(src), m.term)
            out.append(ElectionSend(src, Vote(self.term, False)))
            return
        newer = m.term > self.term
        if newer:  # one Persist below covers the new term and the vote
            self._adopt(m.term, out, f"vote request of term {m.term} from {short_id(src)}", persist=False)
        why = self._refuses_candidate(src, (m.applied_term, m.applied_epoch))
        if why is None and self.voted_for not in (None, src):
            why = f"voted for {short_id(self.voted_for)} in term {self.term}"
        if why is not None:
            logger.debug("vote for %s in term %d refused: %s", short_id(src), m.term, why)
            if newer:
                out.append(Persist(self.term, None))
            out.append(ElectionSend(src, Vote(self.term, False)))
            return
        if self.voted_for is None:
            self._set_term(self.term, src, out)  # Persist(term, src) before the ElectionSend below
        self._deadline = self._now + self._timeout()
        out.append(ElectionSend(src, Vote(self.term, True)))

    def _on_vote(self, src: bytes, m: Vote, out: list[ElectionAction]) -> None:
        if m.term > self.term:
            self._adopt(m.term, out, f"vote reply of term {m.term} from {short_id(src)}")
        elif self.role is ElectionRole.CANDIDATE and m.term == self.term and m.granted:
            self._grants.add(src)
            self._check_votes(out)
