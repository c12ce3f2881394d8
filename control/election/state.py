"""Coordinator election, Raft-style with signed votes, as a sans-IO state machine.

`ElectionState` does no I/O and reads no clock: the driver passes `now`, feeds received
messages to `handle(src, msg, now)`, calls `tick(now)` at `next_deadline()`, and executes the
returned actions *in order*: a `Persist` (write term and vote to disk, fsync, before anything
after it) always precedes the `ElectionSend` of the vote it records. A restarted node is built
from what its store loads (`ElectionStore.load`). Votes are signed by an injected `VoteSigner`
(the peer's `Identity`); signatures are verified with the voter's peer id, which is its
Ed25519 public key. Both are deterministic, so a simulation stays reproducible.

    role           event                                      next role      emits
    follower       election timer (see Timers)                pre-candidate  PreVote to the voters
    pre-candidate  pre-votes of a quorum                      candidate      Persist(term+1, me), RequestVote
    candidate      signed votes of a quorum                   coordinator    BecameCoordinator, Heartbeat
    coordinator    heartbeat timer                            coordinator    Heartbeat (+ certificate) to the voters
    coordinator    acks from < a quorum within lease_s        follower       SteppedDown (check-quorum)
    coordinator    ack of a heartbeat, higher term (bounded)  candidate      Persist(t+1, me), RequestVote
    any            certified Heartbeat of a term >= its own   follower       Persist if newer, HeartbeatAck

Proof of election. A granted vote is the voter's signature of (term, candidate, digest of the
candidate's configuration) (certificate.py). A candidate counts only votes of its configuration
whose signature verifies; elected, it holds them as its `certificate` and sends it with every
heartbeat, and the coordinator puts it beside every allocation it hands out. A peer recognises
a coordinator only on a certificate whose votes from the voters of its own configuration are a
quorum of them (certificate.py: a majority, plus one for an odd count from 5 voters on, so that
one voter signing two votes in a term cannot elect two coordinators), every signature checked (once per certificate: `CertificateCheck` caches by
digest); it never takes its voters from a heartbeat. A peer without a council (a fresh swarm
before the operator's start reaches it, a joiner) recognises no certificate at all and takes
no term from one: any key holder can mint identities whose votes make a quorum of a set they
choose. It gets a council only from an operator's root (`set_root`) or from an allocation whose
council follows from its root (council.py).

Who counts. Messages of the election count only from voters of this peer's council, and only
a voter of it answers pre-votes and votes: a peer outside the council follows (it takes
certified allocations) and never votes; a peer without a council counts nobody. A PreVote or a
RequestVote of anyone else gets no answer, a heartbeat of anyone else changes nothing.

Terms. A higher term is taken only (a) with a certificate for it (at any size: a
quorum voted in it), (b) from a voter answering this peer's own outstanding pre-vote, vote
or heartbeat, or (c) with a vote this peer grants to a voter; in (b) and (c) at most
`config.max_term_jump` above its own. Nothing else moves it. No term arithmetic passes MAX_TERM:
a peer at MAX_TERM refuses to stand (logged; `term_exhausted`) and keeps following.

Votes. A voter grants one vote per term, persisted before it is signed and sent, and only to a
candidate of its configuration whose last applied (term, epoch) is not older than its own (and
whose configuration digest is its own when both applied the same allocation). A pre-vote
changes nothing on the voter. While a voter has heard its coordinator within `lease_s` it
refuses pre-votes and votes for anyone else, without taking their term. The coordinator
itself may stand again: if a voter answers its heartbeat with a higher term (within the jump),
it stands in the term after that one at once (no pre-vote), and its followers grant it.

Timers. A follower stands after uniform(election_timeout_min_s, election_timeout_max_s) plus
rank * stagger_s without hearing its coordinator, its rank being its place in an order of the
voters every peer of the term computes alike (a hash of term and peer id, the coordinator
last): after a crash the first-ranked peer stands about one stagger before the next, so two
candidates rarely split a vote, even when the round trips are as long as the random spread.

Configuration. The voters are the council (council.py) of the last applied allocation
(`apply_allocation`, or `restore` from the disk at start), or of the operator's root
(`set_root`: a start's council for a peer without one, a `council` operation over an older
root). `set_voters` takes a first council on trust (tests and simulations only). Until a node
has a council it neither votes nor stands. `campaign(now)` stands at once (`train start`). When the coordinator
applies a configuration its certificate is not of, it asks the new voters to sign its term
again over the new configuration (they voted for it already, or not at all in this term) and
carries the new certificate once a quorum did: peers that applied the new configuration
recognise it after a restart too. When no quorum did within election_timeout_max_s (a voter
that voted for another candidate in its term never signs it), it stands again in the next
term, in the new configuration.

Undone changes. A configuration change is made by the coordinator's allocation, which some
voters may apply before the coordinator is lost: the rest, a quorum of the previous voters, go
on and elect a coordinator in a later term that never saw it (as in Raft, an entry not yet on a
quorum may be overwritten). So a peer keeps the voters before its last change, with the term of
the allocation that made it, and also recognises a certificate of a later term that is a quorum
of those voters (`previous`, kept on disk beside the applied allocation). It is safe for the
reason a one-voter change is: a quorum of the previous voters and one of the new share a voter,
and a voter that applied the new configuration refuses a candidate whose applied allocation is
older. Once an allocation of a later term keeps the configuration, it is no longer undone.

Allocations. `may_apply(issuer, term, epoch, certificate, council)` refuses an allocation
unless its certificate is of `issuer` in `term`, `term` is not older than this peer's (nor
another coordinator's term here), (term, epoch) is newer than the last applied, its council
follows from this peer's (its own, or its own before an undone change, followed by changes
each one voter, certified by a quorum of the council before, signed by its maker, none made
after (term, epoch), those of `term` by `issuer`; without a council of its own: every change
from the root), and the certificate is a quorum of the allocation's council (or of the council
before the change this allocation makes, or, configured, of its own as above). The root is
the plane's to check (operator.py `check_council`); whether a change agrees with this peer's
gossip, the epoch machine's (`changes_refusal`). `apply_allocation` records it: a certified
newer term is taken, the issuer recognised, the council replaced. `council_for` is the
council a coordinator hands out: its own, with one change it signs when the certificate it
holds is over its current council. The applied (term, epoch) only grows.

Discovery. Heartbeats reach the voters only, so a peer outside the configuration (a fresh
joiner, a peer restarted after the run went on without it) asks other peers who the
coordinator is (discovery.py) and hands each certificate it gets to `learn`: one that verifies
against its own configuration is recognised (the term taken if newer, no lease: a certificate
proves an election, not a live coordinator), one that is only a quorum of its own configuration
is kept as `heard_of` (shown in status), never followed, voted by, or forwarded an operator's
request to; a peer without a council has nothing to verify against, so any certificate it
takes is only heard of. A recognised certificate whose configuration leaves this peer out
means a quorum of its voters moved on without it: it stops standing (nobody would answer its
pre-votes) until its term changes or it applies an allocation. `answer()` is what this peer tells an asker.

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
from typing import Protocol

from dtfm.net import short_id, verify_signature

from ..allocation import Refusal
from .certificate import Certificate, CertificateCheck, config_digest, quorum, vote_payload
from .config import ElectionConfig
from .council import MAX_COUNCIL, Council, CouncilLink, change_refusal, link_payload
from .discovery import CoordinatorAnswer
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
    "PreviousConfiguration",
    "SteppedDown",
    "VoteSigner",
    "trusted_root",
]

logger = logging.getLogger(__name__)

_NEVER = float("inf")
_LONG_AGO = float("-inf")


class VoteSigner(Protocol):
    """Signs this peer's votes: `net.Identity` is one."""

    peer_id: bytes

    def sign(self, data: bytes) -> bytes: ...


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


@dataclass(frozen=True)
class PreviousConfiguration:
    """The voters before this peer's last configuration change, and the term of the
    allocation that changed them."""
    voters: tuple[bytes, ...]
    term: int


@dataclass
class _Round:
    """Signed votes gathered for `candidate` (this peer) in one configuration."""

    voters: tuple[bytes, ...]
    config: bytes
    votes: dict[bytes, bytes]  # voter -> its signature of the vote

    @property
    def complete(self) -> bool:
        return len(self.votes) >= quorum(len(self.voters))


class ElectionState:
    def __init__(self, me: bytes, config: ElectionConfig, rng: random.Random, now: float, *, signer: VoteSigner,
                 term: int = 0, voted_for: bytes | None = None, voters: tuple[bytes, ...] | None = None,
                 applied: tuple[int, int] = (0, 0), previous: PreviousConfiguration | None = None,
                 council: Council | None = None) -> None:
        if type(term) is not int or not 0 <= term <= MAX_TERM:
            raise ValueError(f"term must be in [0, {MAX_TERM}], got {term}")
        if signer.peer_id != me:
            raise ValueError(f"the signer's key ({short_id(signer.peer_id)}) is not this peer's ({short_id(me)})")
        self.me = me
        self.config = config
        self._rng = rng
        self._signer = signer
        self.term = term
        self.voted_for = voted_for
        self.role = ElectionRole.FOLLOWER
        self.coordinator: bytes | None = None  # the coordinator of self.term, as known here
        self.certificate: Certificate | None = None  # the coordinator's, once recognised (own when coordinator)
        self.voters: tuple[bytes, ...] = ()  # self.council.voters, () without a council
        self.council: Council | None = None  # the root and changes that made the voters (council.py)
        self._config: bytes | None = None  # config_digest(self.voters)
        self.previous: PreviousConfiguration | None = None  # before the last change, while it may be undone
        if council is None and voters is not None:
            council = trusted_root(voters)
        if council is not None:
            self._set_configuration(council)
            self.previous = previous
        applied_term, applied_epoch = applied
        self.last_applied: tuple[int, int] = (applied_term, applied_epoch)
        self._checker = CertificateCheck()
        self._now = now
        self._rank_cache: tuple = (None, 0)
        self._heard_at = _LONG_AGO  # when the recognised coordinator was last heard
        self._deadline = now + self._timeout()  # election timer; pre-vote or vote round's end
        self._grants: set[bytes] = set()  # pre-votes of the current pre-vote round
        self._round: _Round | None = None  # votes of the current candidacy
        self._recert: _Round | None = None  # the coordinator's votes over a new configuration
        self._recert_by = _NEVER  # when the coordinator stands again if _recert is not complete
        self._since = now  # coordinator since
        self._next_heartbeat = _NEVER
        self._seq = 0
        self._sent_at: dict[int, float] = {}  # heartbeat seq -> when it left (recent ones)
        self._acked_at: dict[bytes, float] = {}  # voter -> when the last heartbeat it acked left
        self.heard_of: Certificate | None = None  # a coordinator learned of, not recognised (see `learn`)
        self._superseded = False  # a learned certificate says a quorum of this peer's voters moved on

    # ------------------------------------------------------------------ queries

    @property
    def quorum(self) -> int:
        """Votes, pre-votes or acks that decide in this peer's configuration (certificate.quorum)."""
        return quorum(len(self.voters))

    @property
    def term_exhausted(self) -> bool:
        """At the largest term: this peer never stands again (it can still follow and vote)."""
        return self.term >= MAX_TERM

    @property
    def signatures_checked(self) -> int:
        """Vote signatures of certificates verified so far (each certificate once)."""
        return self._checker.verified

    def next_deadline(self) -> float:
        return self._next_heartbeat if self.role is ElectionRole.COORDINATOR else self._deadline

    def check_certificate(self, cert: Certificate) -> str | None:
        """None if `cert` proves its candidate's election to this peer (module docstring), else why not."""
        if self.voters:
            if cert.candidate not in self.voters:
                why: str | None = f"its candidate {short_id(cert.candidate)} is not a voter of this peer's configuration"
            else:
                assert self._config is not None
                why = self._checker.check(cert, self.voters, self._config)
            if why is not None and self._previous_elects(cert):
                return None
            return why
        return ("this peer has no council yet: it recognises a coordinator only through an allocation whose "
                "council comes from the operator's root")

    def may_apply(self, issuer: bytes, term: int, epoch: int, certificate: Certificate | None = None,
                  council: Council | None = None) -> Refusal | None:
        """None if an allocation of `issuer` at (term, epoch), carrying `council` (whose root the
        caller checked against the operators) and `certificate`, may be applied here, else why
        not."""
        if certificate is None:
            return Refusal("bad-certificate", "the allocation carries no certificate of its issuer's election")
        if certificate.term != term or certificate.candidate != issuer:
            return Refusal("bad-certificate", f"its certificate elects {short_id(certificate.candidate)} in term "
                                              f"{certificate.term}, not its issuer {short_id(issuer)} in term {term}")
        if term < self.term:
            return Refusal("stale", f"term {term} is older than this peer's term {self.term}")
        if term == self.term and self.coordinator not in (None, issuer):
            return Refusal("not-coordinator", f"{short_id(issuer)} is not the coordinator of term {term} "
                                              f"({short_id(self.coordinator)} is)")
        if (term, epoch) <= self.last_applied:
            return Refusal("stale", f"term {term} epoch {epoch} is not newer than term {self.last_applied[0]} "
                                    f"epoch {self.last_applied[1]}, already applied")
        if council is None:
            return Refusal("bad-council", "the allocation carries no council")
        if self.voters and issuer not in council.voters and issuer not in self.voters \
                and not self._previous_elects(certificate):
            return Refusal("not-voter", f"the issuer {short_id(issuer)} is not a voter of this peer's council "
                                        "nor of the allocation's")
        refusal = self._council_refusal(issuer, term, epoch, council)
        if refusal is not None:
            return refusal
        over = [council.voters]
        last = council.links[-1] if council.links else None
        if last is not None and last.issuer == issuer and (last.term, last.epoch) == (term, epoch):
            over.append(last.before)  # this allocation may have made the last change: elected before it
        if certificate.voters in over:
            why = self._checker.check(certificate, certificate.voters, certificate.config)
        elif self.voters:
            why = self.check_certificate(certificate)  # (an undone change: the council before it)
        else:
            why = "it is not over the allocation's council"
        if why is not None:
            return Refusal("bad-certificate", f"the certificate of {short_id(issuer)} in term {term}: {why}")
        return None

    def _council_refusal(self, issuer: bytes, term: int, epoch: int, council: Council) -> Refusal | None:
        """None if `council` follows from this peer's (module docstring, council.py): it is this
        peer's with the changes made since, each one voter, certified by a quorum of the council
        before it and signed by its issuer, none after `term`, and those of `term` by `issuer`;
        where this peer's last change may have been undone, its council before that change
        serves as well. A peer without a council checks every change from the root."""
        own = self.council
        bases = [council.truncated(0)] if own is None else [own]
        if own is not None and own.links and self.previous is not None and term > self.previous.term:
            bases.append(own.truncated(len(own.links) - 1))
        for base in bases:
            n = len(base.links)
            if not base.same_root(council) or council.links[:n] != base.links:
                continue
            for link in council.links[n:]:
                if (link.term, link.epoch) > (term, epoch) or (link.term == term and link.issuer != issuer):
                    return Refusal("bad-council", f"the allocation's council has a change of term {link.term} by "
                                                  f"{short_id(link.issuer)}, not one its issuer made before or in "
                                                  f"its term {term}")
            why = council.verify(self._checker, start=n)
            if why is not None:
                return Refusal("bad-council", f"the allocation's council: {why}")
            return None
        assert own is not None
        return Refusal("bad-council", f"the allocation's council ({council.describe()}) does not follow from this "
                                      f"peer's ({own.describe()})")

    # ------------------------------------------------------------------ driver inputs

    def applied(self, term: int, epoch: int) -> None:
        """Record an allocation this node applied (prefer `apply_allocation`, which also takes
        its configuration and certificate)."""
        if (term, epoch) <= self.last_applied:
            raise ValueError(f"applied (term, epoch) only grows: ({term}, {epoch}) after {self.last_applied}")
        self.last_applied = (term, epoch)

    def apply_allocation(self, term: int, epoch: int, council: Council, certificate: Certificate | None,
                         now: float) -> list[ElectionAction]:
        """An allocation this peer applies (`may_apply` said yes): its (term, epoch), its
        council, and the certificate of its issuer, whose term is taken if newer."""
        self._advance(now)
        out: list[ElectionAction] = []
        if (term, epoch) <= self.last_applied:
            logger.warning("allocation of term %d epoch %d not recorded: term %d epoch %d is applied", term, epoch,
                           *self.last_applied)
            return out
        issuer = certificate.candidate if certificate is not None else None
        known = term == self.term and self.coordinator == issuer
        if certificate is not None and issuer != self.me and certificate.term == term >= self.term and not known:
            if self.may_apply(certificate.candidate, term, epoch, certificate, council) is None:
                self._follow(certificate, out, f"allocation of term {term} from {short_id(certificate.candidate)}")
        self.last_applied = (term, epoch)
        self._superseded = False
        if self.voters and config_digest(council.voters) != self._config:
            assert self._config is not None
            self.previous = PreviousConfiguration(self.voters, term)
        elif self.previous is not None and term > self.previous.term:
            self.previous = None  # a coordinator of a later term handed the configuration on: it stands
        self._reconfigure(council, out)
        return out

    def restore(self, term: int, epoch: int, council: Council | None, now: float,
                previous: PreviousConfiguration | None = None) -> list[ElectionAction]:
        """At start: the allocation applied before the restart, from the disk (with the
        `previous` configuration this peer kept then)."""
        self._advance(now)
        out: list[ElectionAction] = []
        if self.last_applied != (0, 0) or (term, epoch) <= (0, 0):
            raise ValueError(f"restore ({term}, {epoch}) on a peer that applied {self.last_applied}")
        self.last_applied = (term, epoch)
        if council is not None:
            self._reconfigure(council, out)
            self.previous = previous
        return out

    def set_voters(self, voters: tuple[bytes, ...], now: float) -> list[ElectionAction]:
        """A first council taken on trust (tests and simulations; a daemon roots its council in
        an operator's signed operation: `set_root`); refused (logged) once an allocation was
        applied or a council is set."""
        self._advance(now)
        out: list[ElectionAction] = []
        if self.last_applied != (0, 0) or self.council is not None:
            logger.warning("set_voters refused: this peer has a council (applied term %d epoch %d); only an "
                           "allocation or an operator's newer root changes it", *self.last_applied)
            return out
        self._reconfigure(trusted_root(voters), out)
        return out

    def set_root(self, council: Council, now: float, *, rerooting: bool = False) -> list[ElectionAction]:
        """A council an operator's signed operation roots (the caller checked the signature and
        that it names `council.root_voters`): taken by a peer without a council (a start's
        first council), or, `rerooting` (an operator's council operation), over this peer's own
        when the operator signed it later than this peer's root. Anything else is ignored."""
        self._advance(now)
        out: list[ElectionAction] = []
        own = self.council
        if council.links:
            logger.warning("a root with links is not a root: ignored")
            return out
        if own is not None and not rerooting:
            return out
        if own is not None and council.root_at_ms <= own.root_at_ms:
            if not own.same_root(council):
                logger.info("an operator's council signed at %d ms is not newer than this peer's root (%d ms): "
                            "ignored", council.root_at_ms, own.root_at_ms)
            return out
        self.previous = None
        self._superseded = False
        self._reconfigure(council, out)
        logger.info("council rooted by the operator: %d voters%s", len(council.voters),
                    "" if self.me in council.voters else " (this peer follows)")
        return out

    def council_for(self, voters: tuple[bytes, ...], epoch: int) -> Council | None:
        """The council of the allocation of `epoch` this coordinator hands out whose voters are
        to be `voters`: this peer's own when they are its voters, else its own with one link it
        signs now; None when the change cannot be made now (not coordinator, not certified over its
        current council yet, a change of more than one voter, or the links are full)."""
        own = self.council
        if own is None or self.role is not ElectionRole.COORDINATOR or self.certificate is None:
            return None
        voters = check_voters(tuple(sorted(voters)))
        if voters == own.voters:
            return own
        if own.full or self.certificate.config != self._config or change_refusal(own.voters, voters) is not None:
            return None
        if len(voters) > len(own.voters) >= own.size:
            return None
        link = CouncilLink(self.certificate, voters,
                           self._signer.sign(link_payload(self.term, epoch, own.voters, voters)), epoch)
        return own.extended(link)

    def revert(self, term: int, voted_for: bytes | None, now: float) -> list[ElectionAction]:
        """Back to the (term, vote) the store holds (or will, once the Persists queued before
        are written), as a follower: the driver refused an input midway (its Persist, or the
        machine raised) and dropped its actions."""
        self._advance(now)
        out: list[ElectionAction] = []
        if self.role is ElectionRole.COORDINATOR:
            self._step_down(out, "an input was refused midway")
        self.role = ElectionRole.FOLLOWER
        self._round = self._recert = None
        if term != self.term:
            self.term = term
            self._recognise(None, out)
        self.voted_for = voted_for
        self._deadline = self._now + self._timeout()
        return out

    def learn(self, cert: Certificate, now: float) -> list[ElectionAction]:
        """A coordinator's certificate another peer passed on (its answer to this peer's
        coordinator query; untrusted). Verified against this peer's configuration, as a
        heartbeat's would be, it is recognised (its term taken if newer), though it proves an
        election, not that the coordinator is alive: this peer's lease is not renewed. A
        certificate that does not verify there (or reaches a peer without a council) but is a
        quorum of its own configuration, every signature checked, is kept as `heard_of` (the
        newest such): a coordinator shown in status, which this peer does not follow, vote by
        or forward an operator's request to. When the
        recognised certificate's configuration leaves this peer out, a quorum of its own voters
        moved on without it: it stops standing (nobody would answer) until its term changes or
        it applies an allocation."""
        self._advance(now)
        out: list[ElectionAction] = []
        if cert.term < self.term or cert.candidate == self.me:
            return out
        if cert.term == self.term and (self.role is ElectionRole.COORDINATOR or self.coordinator == cert.candidate):
            return out
        # (a peer without a council has nothing to verify against: at most it hears of one)
        why = self.check_certificate(cert) if self.voters else "this peer holds no council"
        if why is None:
            self._follow(cert, out, f"certificate of term {cert.term} passed on by a peer", heard=False)
            self._superseded = self.me not in cert.voters
            return out
        if self.heard_of is not None and cert.term <= self.heard_of.term:
            return out
        own = self._checker.check(cert, cert.voters, cert.config)
        if own is None:
            self.heard_of = cert
        else:
            logger.debug("certificate of %s in term %d passed on: %s", short_id(cert.candidate), cert.term, own)
        return out

    @property
    def in_lease(self) -> bool:
        """The coordinator, or a follower that heard its coordinator within lease_s."""
        return self.role is ElectionRole.COORDINATOR or (self.coordinator is not None
                                                          and self._now - self._heard_at < self.config.lease_s)

    def answer(self, now: float) -> CoordinatorAnswer:
        """What this peer tells a peer that asks who the coordinator is (discovery.py)."""
        self._advance(now)
        cert = self.certificate if self.certificate is not None else self.heard_of
        return CoordinatorAnswer(self.term, self.role.value, self.certificate is not None, self.in_lease,
                                 len(self.voters), cert)

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
            if self._recert is not None and now >= self._recert_by and not self.term_exhausted:
                # Voters that voted for another candidate in this term never sign it again:
                # an election in the new configuration gets the certificate its peers check.
                self._step_down(out, f"not certified again by a quorum of the new configuration within "
                                     f"{self.config.election_timeout_max_s:g} s", standing_again=True)
                self._become_candidate(self.term + 1, out)
            elif now >= self._next_heartbeat:
                if self.config.check_quorum and not self._quorum_heard():
                    self._step_down(out, f"no acks from a quorum within {self.config.lease_s:g} s")
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

    # ------------------------------------------------------------------ configuration

    def _set_configuration(self, council: Council) -> None:
        self.council = council
        self.voters = council.voters
        self._config = config_digest(self.voters)

    def _reconfigure(self, council: Council, out: list[ElectionAction]) -> None:
        self._set_configuration(council)
        if self.role is not ElectionRole.COORDINATOR:
            return
        if self.me not in self.voters:
            self._step_down(out, "not a voter of the new configuration")
            return
        assert self.certificate is not None and self._config is not None
        if self.certificate.config == self._config:
            self._recert = None
            return
        self._recert = _Round(self.voters, self._config, {self.me: self._sign(self.term, self.me, self._config)})
        self._recert_by = self._now + self.config.election_timeout_max_s
        self._check_recert()
        self._ask_recert(out)

    def _ask_recert(self, out: list[ElectionAction]) -> None:
        r = self._recert
        if r is None:
            return
        msg = RequestVote(self.term, self.me, *self.last_applied, r.config)
        out.extend(ElectionSend(v, msg) for v in r.voters if v not in r.votes)

    def _check_recert(self) -> None:
        r = self._recert
        if r is not None and r.complete:
            self.certificate = Certificate.of(self.term, self.me, r.voters, r.votes)
            self._recert = None
            logger.info("certified again in term %d, in the new configuration of %d voters", self.term, len(r.voters))

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

    def _within_jump(self, term: int) -> bool:
        """`term` is at most max_term_jump above this peer's (and a term at all)."""
        return term <= MAX_TERM and term - self.term <= self.config.max_term_jump

    # ------------------------------------------------------------------ standing

    def _stand(self, out: list[ElectionAction]) -> None:
        self._deadline = self._now + self._timeout()
        if self.me not in self.voters:
            self.role = ElectionRole.FOLLOWER
            return  # no configuration yet, or not a voter of it: never stands
        if self._superseded:
            self.role = ElectionRole.FOLLOWER
            return  # its voters elected a coordinator in a configuration without it (`learn`)
        if self.term_exhausted:
            self.role = ElectionRole.FOLLOWER
            logger.warning("term %d is the largest there is: this peer does not stand (it still follows and votes)",
                           self.term)
            return
        if self.config.pre_vote:
            self.role = ElectionRole.PRE_CANDIDATE
            self._grants = {self.me}
            msg = PreVote(self.term + 1, self.me, *self.last_applied)
            out.extend(ElectionSend(v, msg) for v in self.voters if v != self.me)
            self._check_pre_votes(out)
        else:
            self._become_candidate(self.term + 1, out)

    def _check_pre_votes(self, out: list[ElectionAction]) -> None:
        if len(self._grants & set(self.voters)) >= self.quorum:
            self._become_candidate(self.term + 1, out)

    def _become_candidate(self, term: int, out: list[ElectionAction]) -> None:
        if not self.term < term <= MAX_TERM or self._config is None or self.me not in self.voters:
            logger.warning("not standing in term %d from term %d", term, self.term)
            self.role = ElectionRole.FOLLOWER
            return
        self._set_term(term, self.me, out)
        self.role = ElectionRole.CANDIDATE
        self._round = _Round(self.voters, self._config, {self.me: self._sign(term, self.me, self._config)})
        self._deadline = self._now + self._timeout()
        msg = RequestVote(self.term, self.me, *self.last_applied, self._config)
        out.extend(ElectionSend(v, msg) for v in self.voters if v != self.me)
        self._check_votes(out)

    def _sign(self, term: int, candidate: bytes, config: bytes) -> bytes:
        return self._signer.sign(vote_payload(term, candidate, config))

    def _check_votes(self, out: list[ElectionAction]) -> None:
        r = self._round
        if self.role is ElectionRole.CANDIDATE and r is not None and r.complete:
            self.role = ElectionRole.COORDINATOR
            self._since = self._now
            self._acked_at = {}
            self._sent_at = {}
            out.append(BecameCoordinator(self.term))
            self._recognise(self.me, out, Certificate.of(self.term, self.me, r.voters, r.votes))
            logger.info("coordinator of term %d with %d of %d votes", self.term, len(r.votes), len(r.voters))
            if r.config != self._config and self.council is not None:  # applied a new configuration meanwhile
                self._reconfigure(self.council, out)
            self._heartbeat(out)

    def _heartbeat(self, out: list[ElectionAction]) -> None:
        assert self.certificate is not None
        self._seq += 1
        self._sent_at[self._seq] = self._now
        keep = int(self.config.lease_s / self.config.heartbeat_interval_s) + 2
        self._sent_at.pop(self._seq - keep, None)
        self._next_heartbeat = self._now + self.config.heartbeat_interval_s
        msg = Heartbeat(self.term, self.me, self._seq, *self.last_applied, self.certificate)
        out.extend(ElectionSend(v, msg) for v in self.voters if v != self.me)
        self._ask_recert(out)

    def _quorum_heard(self) -> bool:
        if self._now - self._since < self.config.lease_s:
            return True
        since = self._now - self.config.lease_s
        heard = sum(1 for v in self.voters if v == self.me or self._acked_at.get(v, _LONG_AGO) >= since)
        return heard >= self.quorum

    def _step_down(self, out: list[ElectionAction], reason: str, standing_again: bool = False) -> None:
        self.role = ElectionRole.FOLLOWER
        self._next_heartbeat = _NEVER
        self._deadline = self._now + self._timeout()
        self._recert = None
        self._recognise(None, out)
        out.append(SteppedDown(self.term, reason, standing_again))
        logger.info("stepped down in term %d: %s", self.term, reason)

    # ------------------------------------------------------------------ terms

    def _set_term(self, term: int, voted_for: bytes | None, out: list[ElectionAction], persist: bool = True) -> None:
        if term != self.term:
            self.term = term
            self._superseded = False
            self._recognise(None, out)
        self.voted_for = voted_for
        if persist:
            out.append(Persist(term, voted_for))

    def _adopt(self, term: int, out: list[ElectionAction], why: str, persist: bool = True) -> None:
        """Follow a higher term (no vote in it yet); the caller checked the evidence for it."""
        if self.role is ElectionRole.COORDINATOR:
            self._step_down(out, why)
        self.role = ElectionRole.FOLLOWER
        self._round = None
        self._set_term(term, None, out, persist)

    def _recognise(self, coordinator: bytes | None, out: list[ElectionAction], cert: Certificate | None = None) -> None:
        self.certificate = cert if coordinator is not None else None
        if cert is not None and self.heard_of is not None and self.heard_of.term <= cert.term:
            self.heard_of = None
        if coordinator != self.coordinator:
            self.coordinator = coordinator
            out.append(CoordinatorKnown(self.term, coordinator))

    def _follow(self, cert: Certificate, out: list[ElectionAction], why: str, heard: bool = True) -> None:
        """Recognise the certified coordinator of cert.term (>= this peer's term; checked);
        `heard`: from the coordinator itself (its lease starts)."""
        if cert.term > self.term:
            self._adopt(cert.term, out, why)
        if self.coordinator != cert.candidate or self.certificate is None:
            self._recognise(cert.candidate, out, cert)
        self.role = ElectionRole.FOLLOWER
        self._round = None
        if heard:
            self._heard_at = self._now
            self._superseded = False
        self._deadline = self._now + self._timeout()

    # ------------------------------------------------------------------ messages

    def _previous_elects(self, cert: Certificate) -> bool:
        """`cert` elects its candidate in the configuration before this peer's last change, in
        a term after the change: the change may never have reached a quorum of the new voters
        (its coordinator was lost first), and the swarm went on without it (module docstring)."""
        prev = self.previous
        return (prev is not None and cert.term > prev.term and cert.candidate in prev.voters
                and self._checker.check(cert, prev.voters, config_digest(prev.voters)) is None)

    def _counts(self, src: bytes) -> bool:
        """Messages of the election count from voters of this peer's council (from nobody
        while it has none)."""
        return src in self.voters

    def _votes(self) -> bool:
        """This peer answers pre-votes and votes: it is a voter of its council."""
        return self.me in self.voters

    def _on_heartbeat(self, src: bytes, m: Heartbeat, out: list[ElectionAction]) -> None:
        if m.coordinator != src:
            logger.debug("heartbeat from %s names coordinator %s: ignored", short_id(src), short_id(m.coordinator))
            return
        if not self._counts(src):
            logger.debug("heartbeat from %s, not a voter of this peer's configuration: ignored", short_id(src))
            return
        if m.term < self.term:
            out.append(ElectionSend(src, HeartbeatAck(self.term, m.seq, False, *self.last_applied)))
            return
        if m.term == self.term and src == self.coordinator and src != self.me:
            cert = self.certificate
            if (cert is None or m.certificate.digest != cert.digest) and self.check_certificate(m.certificate) is None:
                self.certificate = m.certificate  # certified again (a new configuration)
        else:
            if self.role is ElectionRole.COORDINATOR and m.term == self.term:
                logger.error("heartbeat of %s as coordinator of term %d, this peer's own term", short_id(src), m.term)
                return
            why = self.check_certificate(m.certificate)
            if why is not None:
                logger.debug("heartbeat of %s in term %d refused: %s", short_id(src), m.term, why)
                return
        self._follow(m.certificate, out, f"heartbeat of term {m.term} from {short_id(src)}")
        out.append(ElectionSend(src, HeartbeatAck(self.term, m.seq, True, *self.last_applied)))

    def _on_ack(self, src: bytes, m: HeartbeatAck, out: list[ElectionAction]) -> None:
        if self.role is not ElectionRole.COORDINATOR or src not in self.voters:
            return
        if m.term > self.term:
            if m.seq not in self._sent_at:
                logger.debug("ack of term %d from %s answers no recent heartbeat: ignored", m.term, short_id(src))
                return
            stand = self.config.pre_vote
            if not self._within_jump(m.term + 1 if stand else m.term):
                logger.warning("voter %s acks in term %d, more than %d above term %d: ignored", short_id(src),
                               m.term, self.config.max_term_jump, self.term)
                return
            if stand:  # a voter ahead: stand again at once, above its term
                why = f"voter {short_id(src)} is in term {m.term}: standing in term {m.term + 1}"
                self._step_down(out, why, standing_again=True)
                self._become_candidate(m.term + 1, out)
            else:
                self._adopt(m.term, out, f"voter {short_id(src)} is in term {m.term}")
            return
        if m.term == self.term and m.ok and m.seq in self._sent_at:
            self._acked_at[src] = max(self._acked_at.get(src, _LONG_AGO), self._sent_at[m.seq])

    def _refuses_candidate(self, applied: tuple[int, int], config: bytes | None) -> str | None:
        if applied < self.last_applied:
            return f"its last applied {applied} is older than this peer's {self.last_applied}"
        if (config is not None and self._config is not None and applied == self.last_applied != (0, 0)
                and config != self._config):
            return "it stands in another configuration than the one of the allocation both applied"
        return None

    def _on_pre_vote(self, src: bytes, m: PreVote, out: list[ElectionAction]) -> None:
        if m.candidate != src:
            return
        if not self._counts(src) or not self._votes():
            logger.debug("pre-vote for %s: not a voter of this peer's council, or this peer is none, no answer",
                         short_id(src))
            return
        why = self._refuses_candidate((m.applied_term, m.applied_epoch), None)
        if self._in_lease():
            why = "its coordinator is alive"
        elif m.term < self.term or (m.term == self.term and (self.voted_for not in (None, src) or self.coordinator)):
            why = f"term {m.term} is not newer than this peer's term {self.term}"
        elif not self._within_jump(m.term):
            why = f"term {m.term} is more than {self.config.max_term_jump} above this peer's term {self.term}"
        if why:
            logger.debug("pre-vote for %s in term %d refused: %s", short_id(src), m.term, why)
        out.append(ElectionSend(src, PreVoteReply(m.term, why is None, self.term)))

    def _on_pre_vote_reply(self, src: bytes, m: PreVoteReply, out: list[ElectionAction]) -> None:
        if self.role is not ElectionRole.PRE_CANDIDATE or m.term != self.term + 1 or src not in self.voters:
            return  # not an answer to this peer's outstanding pre-vote
        if m.voter_term > self.term:
            if self._within_jump(m.voter_term):
                self._adopt(m.voter_term, out, f"pre-vote reply of term {m.voter_term} from {short_id(src)}")
            else:
                logger.debug("pre-vote reply of term %d from %s: too far ahead, ignored", m.voter_term, short_id(src))
            return
        if m.granted:
            self._grants.add(src)
            self._check_pre_votes(out)

    def _on_request_vote(self, src: bytes, m: RequestVote, out: list[ElectionAction]) -> None:
        if m.candidate != src:
            return
        if not self._counts(src) or not self._votes():
            logger.debug("vote for %s: not a voter of this peer's council, or this peer is none, no answer",
                         short_id(src))
            return
        why = None
        if m.term < self.term:
            why = f"term {m.term} is older than this peer's term {self.term}"
        elif self._in_lease() and src != self.coordinator:
            why = "its coordinator is alive"
        elif not self._within_jump(m.term):
            why = f"term {m.term} is more than {self.config.max_term_jump} above this peer's term {self.term}"
        else:
            why = self._refuses_candidate((m.applied_term, m.applied_epoch), m.config)
            if why is None and m.term == self.term and self.voted_for not in (None, src):
                assert self.voted_for is not None
                why = f"voted for {short_id(self.voted_for)} in term {self.term}"
        if why is not None:
            logger.debug("vote for %s in term %d refused: %s", short_id(src), m.term, why)
            out.append(ElectionSend(src, Vote(m.term, False, self.term, b"")))
            return
        if m.term > self.term:  # one Persist below covers the new term and the vote
            self._adopt(m.term, out, f"vote request of term {m.term} from {short_id(src)}", persist=False)
        if self.voted_for is None:
            self._set_term(self.term, src, out)  # Persist(term, src) before the ElectionSend below
        self._deadline = self._now + self._timeout()
        out.append(ElectionSend(src, Vote(m.term, True, self.term, self._sign(m.term, src, m.config))))

    def _on_vote(self, src: bytes, m: Vote, out: list[ElectionAction]) -> None:
        if m.term != self.term:
            return  # not an answer to a request of this peer's term
        if self.role is ElectionRole.CANDIDATE:
            r = self._round
            if r is None or src not in r.voters:
                return
            if not m.granted:
                if m.voter_term > self.term:  # a voter ahead answers this peer's request
                    if self._within_jump(m.voter_term):
                        self._adopt(m.voter_term, out, f"vote reply of term {m.voter_term} from {short_id(src)}")
                    else:
                        logger.debug("vote reply of term %d from %s: too far ahead, ignored", m.voter_term,
                                     short_id(src))
                return
            if self._signed(src, m, r):
                self._check_votes(out)
        elif self.role is ElectionRole.COORDINATOR and m.granted:
            cert = self.certificate
            assert cert is not None
            recert = self._recert
            if recert is not None and src in recert.voters and self._signed(src, m, recert):
                self._check_recert()
            elif src in cert.voters and src not in cert.signers and recert is None:
                late = _Round(cert.voters, cert.config, dict(cert.signed()))
                if self._signed(src, m, late):  # a late vote: the certificate convinces more peers
                    self.certificate = Certificate.of(self.term, self.me, late.voters, late.votes)

    def _signed(self, src: bytes, m: Vote, r: _Round) -> bool:
        """Add src's vote to r if its signature is of this peer in this term in r's configuration."""
        if src in r.votes:
            return False
        if not verify_signature(src, vote_payload(self.term, self.me, r.config), m.signature):
            logger.debug("vote of %s in term %d: not its signature of this configuration", short_id(src), self.term)
            return False
        r.votes[src] = m.signature
        return True


def trusted_root(voters: tuple[bytes, ...]) -> Council:
    """A council of `voters` with no operator's root (`set_voters`: tests and simulations)."""
    return Council(b"", check_voters(tuple(voters)), 0, min(MAX_COUNCIL, max(5, len(voters))))
