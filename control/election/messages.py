"""Messages of the coordinator election: frozen dataclasses with a checked wire form.

All six travel as one control message type; the wire map's `k` field (`ElectionKind`) names
which. `decode_election` is the one entry point for a body from the network and raises only
`ProtocolError`: every field is checked for type and range, peer ids are 32 bytes, voter lists
are sorted without repeats.

    PreVote        candidate -> voters   "would you vote for me in `term`?" (changes nothing)
    PreVoteReply   voter -> candidate    granted or not, and the voter's own term
    RequestVote    candidate -> voters   the real request; a granted vote is persisted first
    Vote           voter -> candidate    granted or not, in the voter's (possibly newer) term
    Heartbeat      coordinator -> voters term, coordinator, voters, last applied (term, epoch)
    HeartbeatAck   voter -> coordinator  echoes the heartbeat's seq; ok: the voter follows it
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import ClassVar, Self

from dtfm.net import PEER_ID_BYTES, ProtocolError, get_bool, get_bytes, get_dict, get_int, get_list

__all__ = [
    "MAX_TERM", "MAX_VOTERS", "ElectionKind", "ElectionMessage", "Heartbeat", "HeartbeatAck", "PreVote",
    "PreVoteReply", "RequestVote", "Vote", "check_voters", "decode_election",
]

MAX_TERM = 2**63 - 1  # terms, epochs and heartbeat sequence numbers
MAX_VOTERS = 4096  # as many as an allocation may name


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


def check_voters(voters: object) -> tuple[bytes, ...]:
    """`voters` as a tuple: 1 to MAX_VOTERS peer ids, sorted, no repeats; else TypeError or ValueError."""
    if not isinstance(voters, (tuple, list)):
        raise TypeError(f"voters must be a sequence of peer ids, got {type(voters).__name__}")
    out = tuple(voters)
    if not 1 <= len(out) <= MAX_VOTERS:
        raise ValueError(f"a configuration has 1 to {MAX_VOTERS} voters, got {len(out)}")
    for v in out:
        _peer("voter", v)
    if any(a >= b for a, b in itertools.pairwise(out)):
        raise ValueError("voters must be sorted, without repeats")
    return out


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
    """`term` is the term the candidate stands in (already its own)."""

    kind = ElectionKind.REQUEST_VOTE


@dataclass(frozen=True)
class Vote:
    term: int  # the voter's term after handling the request
    granted: bool
    kind = ElectionKind.VOTE

    def __post_init__(self) -> None:
        _int("term", self.term, 0)
        _bool("granted", self.granted)

    def to_wire(self) -> dict:
        return {"k": int(self.kind), "t": self.term, "g": self.granted}

    @classmethod
    def from_wire(cls, d: dict) -> Vote:
        return _checked(cls, term=get_int(d, "t", 0, MAX_TERM), granted=get_bool(d, "g"))


@dataclass(frozen=True)
class Heartbeat:
    term: int
    coordinator: bytes  # must be the sender and one of the voters
    seq: int  # echoed by the ack, so the coordinator knows when the acked heartbeat left
    voters: tuple[bytes, ...]  # the coordinator's configuration, sorted
    applied_term: int  # the coordinator's last applied (term, epoch)
    applied_epoch: int
    kind = ElectionKind.HEARTBEAT

    def __post_init__(self) -> None:
        _int("term", self.term, 1)
        _peer("coordinator", self.coordinator)
        _int("seq", self.seq, 0)
        object.__setattr__(self, "voters", check_voters(self.voters))
        if self.coordinator not in self.voters:
            raise ValueError("the coordinator is not one of the voters")
        _int("applied_term", self.applied_term, 0)
        _int("applied_epoch", self.applied_epoch, 0)

    def to_wire(self) -> dict:
        return {"k": int(self.kind), "t": self.term, "c": self.coordinator, "s": self.seq,
                "v": list(self.voters), "at": self.applied_term, "ae": self.applied_epoch}

    @classmethod
    def from_wire(cls, d: dict) -> Heartbeat:
        items = get_list(d, "v", MAX_VOTERS)
        voters = tuple(get_bytes({"v": x}, "v", PEER_ID_BYTES, PEER_ID_BYTES) for x in items)
        return _checked(cls, term=get_int(d, "t", 1, MAX_TERM),
                        coordinator=get_bytes(d, "c", PEER_ID_BYTES, PEER_ID_BYTES),
                        seq=get_int(d, "s", 0, MAX_TERM), voters=voters, **_applied(d))


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
_FIELDS = {ElectionKind.PRE_VOTE: 5, ElectionKind.PRE_VOTE_REPLY: 4, ElectionKind.REQUEST_VOTE: 5,
           ElectionKind.VOTE: 3, ElectionKind.HEARTBEAT: 7, ElectionKind.HEARTBEAT_ACK: 6}


def decode_election(obj: object) -> ElectionMessage:
    """The election message in a decoded wire body; raises only ProtocolError."""
    d = get_dict(obj, "election message")
    kind = ElectionKind(get_int(d, "k", 0, len(ElectionKind) - 1))
    if len(d) != _FIELDS[kind]:
        raise ProtocolError(f"election {kind.name}: {len(d)} fields, expected {_FIELDS[kind]}")
    return _CLASSES[kind].from_wire(d)
