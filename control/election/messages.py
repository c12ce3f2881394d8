"""Messages of the coordinator election: frozen dataclasses with a checked wire form.

All six travel as one control message type; the wire map's `k` field (`ElectionKind`) names
which. `decode_election` is the one entry point for a body from the network and raises only
`ProtocolError`: every field is checked for type and range, peer ids are 32 bytes, voter lists
are sorted without repeats, a certificate is bounded (MAX_VOTERS) and consistent with the
message that carries it before any signature in it is looked at (certificate.py).

    PreVote        candidate -> voters   "would you vote for me in `term`?" (changes nothing)
    PreVoteReply   voter -> candidate    granted or not, and the voter's own term
    RequestVote    candidate -> voters   the real request, with the digest of the candidate's
                                         configuration; a granted vote is persisted first
    Vote           voter -> candidate    the answer to a RequestVote of `term`: granted (with the
                                         voter's signature of the vote) or not, and the voter's term
    Heartbeat      coordinator -> voters term, coordinator, last applied (term, epoch), and the
                                         certificate of the coordinator's election
    HeartbeatAck   voter -> coordinator  echoes the heartbeat's seq; ok: the voter follows it
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Self

from dtfm.net import PEER_ID_BYTES, ProtocolError, get_bool, get_bytes, get_dict, get_int

from .certificate import DIGEST_BYTES, Certificate
from .limits import MAX_TERM, MAX_VOTERS, SIGNATURE_BYTES, check_voters

__all__ = [
    "MAX_TERM", "MAX_VOTERS", "ElectionKind", "ElectionMessage", "Heartbeat", "HeartbeatAck", "PreVote",
    "PreVoteReply", "RequestVote", "Vote", "check_voters", "decode_election",
]


class ElectionKind(enum.IntEnum):
    """The wire's `k` field. Append only: a number, once used, keeps its meaning."""

    PRE_VOTE = 0
    PRE_VOTE_REPLY = 1
    REQUEST_VOTE = 2
    VOTE = 3
    HEARTBEAT = 4
    HEARTBEAT_ACK = 5


def _int(what: str, v: object, lo: int, hi: int = MAX_TERM) -> None:
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{what} must be an integer in [{lo}, {hi}], got {v!r}")


def _peer(what: str, v: object) -> None:
    if type(v) is not bytes or len(v) != PEER_ID_BYTES:
        raise ValueError(f"{what} must be a {PEER_ID_BYTES}-byte peer id, got {v!r:.80}")


def _bool(what: str, v: object) -> None:
    if type(v) is not bool:
        raise ValueError(f"{what} must be a bool, got {v!r}")


def _checked(cls, **values):
    """cls(**values), with the dataclass's checks reported as ProtocolError."""
    try:
        return cls(**values)
    except ValueError as e:
        raise ProtocolError(f"{cls.__name__}: {e}") from None


def _applied(d: dict) -> dict:
    return {"applied_term": get_int(d, "at", 0, MAX_TERM), "applied_epoch": get_int(d, "ae", 0, MAX_TERM)}


@dataclass(frozen=True)
class _Ballot:
    """A candidate's request to the voters: PreVote or RequestVote, the same fields."""

    term: int
    candidate: bytes
    applied_term: int  # (term, epoch) of the last allocation the candidate applied; (0, 0): none
    applied_epoch: int
    kind: ClassVar[ElectionKind]

    def __post_init__(self) -> None:
        _int("term", self.term, 1)
        _peer("candidate", self.candidate)
        _int("applied_term", self.applied_term, 0)
        _int("applied_epoch", self.applied_epoch, 0)

    def to_wire(self) -> dict:
        return {"k": int(self.kind), "t": self.term, "c": self.candidate, "at": self.applied_term,
                "ae": self.applied_epoch}

    @classmethod
    def from_wire(cls, d: dict) -> Self:
        return _checked(cls, term=get_int(d, "t", 1, MAX_TERM),
                        candidate=get_bytes(d, "c", PEER_ID_BYTES, PEER_ID_BYTES), **_applied(d))


@dataclass(frozen=True)
class PreVote(_Ballot):
    """`term` is the term the candidate would stand in: its own term + 1."""

    kind = ElectionKind.PRE_VOTE


@dataclass(frozen=True)
class PreVoteReply:
    term: int  # the term of the PreVote answered
    granted: bool
    voter_term: int  # the voter's current term: a candidate that is behind learns it
    kind = ElectionKind.PRE_VOTE_REPLY

    def __post_init__(self) -> None:
        _int("term", self.term, 1)
        _bool("granted", self.granted)
        _int("voter_term", self.voter_term, 0)

    def to_wire(self) -> dict:
        return {"k": int(self.kind), "t": self.term, "g": self.granted, "vt": self.voter_term}

    @classmethod
    def from_wire(cls, d: dict) -> PreVoteReply:
        return _checked(cls, term=get_int(d, "t", 1, MAX_TERM), granted=get_bool(d, "g"),
                        voter_term=get_int(d, "vt", 0, MAX_TERM))


@dataclass(frozen=True)
class RequestVote(_Ballot):
    """`term` is the term the candidate stands in (already its own); `config` the digest of the
    configuration it stands in (`config_digest`), which a granted vote signs."""

    config: bytes
    kind = ElectionKind.REQUEST_VOTE

    def __post_init__(self) -> None:
        super().__post_init__()
        if type(self.config) is not bytes or len(self.config) != DIGEST_BYTES:
            raise ValueError(f"config must be a {DIGEST_BYTES}-byte digest, got {self.config!r:.80}")

    def to_wire(self) -> dict:
        return {**super().to_wire(), "d": self.config}

    @classmethod
    def from_wire(cls, d: dict) -> RequestVote:
        return _checked(cls, term=get_int(d, "t", 1, MAX_TERM),
                        candidate=get_bytes(d, "c", PEER_ID_BYTES, PEER_ID_BYTES), **_applied(d),
                        config=get_bytes(d, "d", DIGEST_BYTES, DIGEST_BYTES))


@dataclass(frozen=True)
class Vote:
    term: int  # the term of the RequestVote answered
    granted: bool
    voter_term: int  # the voter's term after handling the request: above `term` when it is ahead
    signature: bytes  # granted: the voter's signature of the vote (certificate.vote_payload); else empty
    kind = ElectionKind.VOTE

    def __post_init__(self) -> None:
        _int("term", self.term, 1)
        _bool("granted", self.granted)
        _int("voter_term", self.voter_term, 0)
        if type(self.signature) is not bytes:
            raise ValueError("signature must be bytes")
        if self.granted and (len(self.signature) != SIGNATURE_BYTES or self.voter_term != self.term):
            raise ValueError(f"a granted vote carries a {SIGNATURE_BYTES}-byte signature, in the term it grants")
        if not self.granted and self.signature:
            raise ValueError("a refused vote carries no signature")

    def to_wire(self) -> dict:
        return {"k": int(self.kind), "t": self.term, "g": self.granted, "vt": self.voter_term, "sig": self.signature}

    @classmethod
    def from_wire(cls, d: dict) -> Vote:
        return _checked(cls, term=get_int(d, "t", 1, MAX_TERM), granted=get_bool(d, "g"),
                        voter_term=get_int(d, "vt", 0, MAX_TERM), signature=get_bytes(d, "sig", 0, SIGNATURE_BYTES))


@dataclass(frozen=True)
class Heartbeat:
    term: int
    coordinator: bytes  # must be the sender
    seq: int  # echoed by the ack, so the coordinator knows when the acked heartbeat left
    applied_term: int  # the coordinator's last applied (term, epoch)
    applied_epoch: int
    certificate: Certificate  # of the coordinator's election in `term`: its voters are its configuration
    kind = ElectionKind.HEARTBEAT

    def __post_init__(self) -> None:
        _int("term", self.term, 1)
        _peer("coordinator", self.coordinator)
        _int("seq", self.seq, 0)
        _int("applied_term", self.applied_term, 0)
        _int("applied_epoch", self.applied_epoch, 0)
        if not isinstance(self.certificate, Certificate):
            raise ValueError("a heartbeat carries the certificate of its coordinator's election")
        if self.certificate.term != self.term or self.certificate.candidate != self.coordinator:
            raise ValueError("the certificate is not of this coordinator in this term")

    @property
    def voters(self) -> tuple[bytes, ...]:
        """The configuration the coordinator was elected in (its certificate's)."""
        return self.certificate.voters

    def to_wire(self) -> dict:
        return {"k": int(self.kind), "t": self.term, "c": self.coordinator, "s": self.seq,
                "at": self.applied_term, "ae": self.applied_epoch, "cert": self.certificate.to_wire()}

    @classmethod
    def from_wire(cls, d: dict) -> Heartbeat:
        return _checked(cls, term=get_int(d, "t", 1, MAX_TERM),
                        coordinator=get_bytes(d, "c", PEER_ID_BYTES, PEER_ID_BYTES),
                        seq=get_int(d, "s", 0, MAX_TERM), **_applied(d),
                        certificate=Certificate.from_wire(d.get("cert")))


@dataclass(frozen=True)
class HeartbeatAck:
    term: int  # the voter's term: higher than the heartbeat's when the voter is ahead
    seq: int  # the heartbeat's seq
    ok: bool  # the voter follows this coordinator in this term
    applied_term: int
    applied_epoch: int
    kind = ElectionKind.HEARTBEAT_ACK

    def __post_init__(self) -> None:
        _int("term", self.term, 0)
        _int("seq", self.seq, 0)
        _bool("ok", self.ok)
        _int("applied_term", self.applied_term, 0)
        _int("applied_epoch", self.applied_epoch, 0)

    def to_wire(self) -> dict:
        return {"k": int(self.kind), "t": self.term, "s": self.seq, "ok": self.ok, "at": self.applied_term,
                "ae": self.applied_epoch}

    @classmethod
    def from_wire(cls, d: dict) -> HeartbeatAck:
        return _checked(cls, term=get_int(d, "t", 0, MAX_TERM), seq=get_int(d, "s", 0, MAX_TERM),
                        ok=get_bool(d, "ok"), **_applied(d))


ElectionMessage = PreVote | PreVoteReply | RequestVote | Vote | Heartbeat | HeartbeatAck

_CLASSES = {cls.kind: cls for cls in (PreVote, PreVoteReply, RequestVote, Vote, Heartbeat, HeartbeatAck)}
_FIELDS = {ElectionKind.PRE_VOTE: 5, ElectionKind.PRE_VOTE_REPLY: 4, ElectionKind.REQUEST_VOTE: 6,
           ElectionKind.VOTE: 5, ElectionKind.HEARTBEAT: 7, ElectionKind.HEARTBEAT_ACK: 6}


def decode_election(obj: object) -> ElectionMessage:
    """The election message in a decoded wire body; raises only ProtocolError."""
    d = get_dict(obj, "election message")
    kind = ElectionKind(get_int(d, "k", 0, len(ElectionKind) - 1))
    if len(d) != _FIELDS[kind]:
        raise ProtocolError(f"election {kind.name}: {len(d)} fields, expected {_FIELDS[kind]}")
    return _CLASSES[kind].from_wire(d)
