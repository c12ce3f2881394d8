"""Gossip message types (range 32-63) and the membership messages.

ONLY APPEND TO MsgType: the numbers are on the wire. Every message is a frozen dataclass whose
`from_wire()` checks each field and raises only `ProtocolError`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from dtfm.net import PEER_ID_BYTES, ProtocolError, get_bool, get_bytes, get_int

from .claims import Update, updates_from_wire

__all__ = ["MsgType", "Ping", "Ack", "PingReq", "Nack", "Gossip", "PushPull", "decode_swim",
           "MAX_SEQ", "MAX_UPDATES", "MAX_PUSH_PULL_UPDATES"]

MAX_SEQ = 2**63 - 1
MAX_UPDATES = 64  # piggybacked updates per message
MAX_PUSH_PULL_UPDATES = 1024  # updates in one page of a push-pull (a full state takes several)


class MsgType(enum.IntEnum):
    PING = 32
    ACK = 33
    PING_REQ = 34
    NACK = 35
    GOSSIP = 36
    PUSH_PULL = 37
    RECORD_SYNC = 38
    MEASURE_PING = 39
    MEASURE_BULK = 40
    MEASURE_LINKS = 41


def _updates(updates: Iterable[Update]) -> list:
    return [m.to_wire() for m in updates]


def _need_map(body: object) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(f"expected a map body, got {type(body).__name__}")
    return body


@dataclass(frozen=True)
class Ping:
    seq: int
    target: bytes  # the peer id meant; a restarted peer at a reused address ignores it
    updates: tuple[Update, ...] = ()
    type = MsgType.PING

    def to_wire(self) -> dict:
        return {"seq": self.seq, "target": self.target, "u": _updates(self.updates)}

    @classmethod
    def from_wire(cls, body: object) -> "Ping":
        d = _need_map(body)
        return cls(get_int(d, "seq", 0, MAX_SEQ), get_bytes(d, "target", PEER_ID_BYTES, PEER_ID_BYTES),
                   updates_from_wire(d, "u", MAX_UPDATES))


@dataclass(frozen=True)
class Ack:
    seq: int
    updates: tuple[Update, ...] = ()
    type = MsgType.ACK

    def to_wire(self) -> dict:
        return {"seq": self.seq, "u": _updates(self.updates)}

    @classmethod
    def from_wire(cls, body: object) -> "Ack":
        d = _need_map(body)
        return cls(get_int(d, "seq", 0, MAX_SEQ), updates_from_wire(d, "u", MAX_UPDATES))


@dataclass(frozen=True)
class PingReq:
    seq: int
    target: bytes  # whom to probe; the relay pings the address its own table holds
    updates: tuple[Update, ...] = ()
    type = MsgType.PING_REQ

    def to_wire(self) -> dict:
        return {"seq": self.seq, "target": self.target, "u": _updates(self.updates)}

    @classmethod
    def from_wire(cls, body: object) -> "PingReq":
        d = _need_map(body)
        return cls(get_int(d, "seq", 0, MAX_SEQ), get_bytes(d, "target", PEER_ID_BYTES, PEER_ID_BYTES),
                   updates_from_wire(d, "u", MAX_UPDATES))


@dataclass(frozen=True)
class Nack:
    seq: int
    type = MsgType.NACK

    def to_wire(self) -> dict:
        return {"seq": self.seq}

    @classmethod
    def from_wire(cls, body: object) -> "Nack":
        return cls(get_int(_need_map(body), "seq", 0, MAX_SEQ))


@dataclass(frozen=True)
class Gossip:
    updates: tuple[Update, ...]
    type = MsgType.GOSSIP

    def to_wire(self) -> dict:
        return {"u": _updates(self.updates)}

    @classmethod
    def from_wire(cls, body: object) -> "Gossip":
        return cls(updates_from_wire(_need_map(body), "u", MAX_UPDATES))


@dataclass(frozen=True)
class PushPull:
    """One page of a full-state exchange: the claims (and accusations) of some members. A
    state is sent as as many pages as it takes; only the first asks for a reply."""

    updates: tuple[Update, ...]
    reply: bool  # True: the sender wants our full state back
    type = MsgType.PUSH_PULL

    def to_wire(self) -> dict:
        return {"m": _updates(self.updates), "reply": self.reply}

    @classmethod
    def from_wire(cls, body: object) -> "PushPull":
        d = _need_map(body)
        return cls(updates_from_wire(d, "m", MAX_PUSH_PULL_UPDATES), get_bool(d, "reply"))


SwimMessage = Ping | Ack | PingReq | Nack | Gossip | PushPull

_SWIM: dict[int, type[SwimMessage]] = {MsgType.PING: Ping, MsgType.ACK: Ack, MsgType.PING_REQ: PingReq,
                                       MsgType.NACK: Nack, MsgType.GOSSIP: Gossip, MsgType.PUSH_PULL: PushPull}


def decode_swim(msg_type: int, body: object) -> SwimMessage:
    cls = _SWIM.get(msg_type)
    if cls is None:
        raise ProtocolError(f"not a membership message type: {msg_type}")
    return cls.from_wire(body)
