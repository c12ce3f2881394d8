"""Peers' answers to the coordinator's requests, typed once at the shell.

The coordinator asks its peers with `Ask` (control/actions.py); the shell collects each peer's
reply and reads it here, by what was asked (the request's message type and, for RUN_STATE, its
`op`), into one `PeerAnswer`:

    ALLOCATION          AllocationAnswer
    START               StartAnswer
    STOP                StopAnswer
    RUN_STATE query     PeerRunState      (Malformed when it does not read as one)
    RUN_STATE reach     ReachAnswer       (Malformed when its peer lists do not read)
    RUN_STATE offer     OfferAnswer
    RUN_STATE keep      KeepAnswer

and `NoAnswer` for a peer that did not answer in time or could not be reached (the shell's
reason), or that refused a run-state query or a reach (`{"error": ...}` in place of the answer:
it counts as none, as it always did). The machines read these types, never a wire map: a
peer's answer is untrusted, so each `from_wire` here reads any value without raising (a
malformed field reads as no acceptance, no offer, no code: "malformed"), and `read_answers` is
the one function the daemon's shell, the simulation and the test fixtures call. Pure: no
socket, clock, file or thread.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

from dtfm.net import ProtocolError, short_id

from .reach import ReachAnswer
from .epoch.runstate import PeerRunState
from .messages import ControlMsg

__all__ = [
    "MAX_REASON", "AllocationAnswer", "KeepAnswer", "Malformed", "NoAnswer", "OfferAnswer", "PeerAnswer",
    "StartAnswer", "StopAnswer", "read_answer", "read_answers", "refusal_code",
]

logger = logging.getLogger(__name__)

MAX_REASON = 512  # characters of a peer's reason kept
_CODE = re.compile(r"[a-z][a-z-]{0,31}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def refusal_code(v: object) -> str | None:
    """A refusing peer's code (untrusted: a short lower-case word), "malformed" for any other
    value, None when it gave none."""
    if v is None:
        return None
    if isinstance(v, str) and _CODE.fullmatch(v):
        return v
    return "malformed"


def _amount(v: object) -> float:
    """A count or a duration a peer reported, or 0 for anything else."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return 0.0
    return float(v) if 0 <= v < 1e18 else 0.0


def _text(v: object) -> str | None:
    return None if v is None else str(v)[:MAX_REASON]


def _reason(d: dict) -> str | None:
    return _text(d.get("error", d.get("reason")))


def _as_map(obj: object) -> dict:
    return obj if isinstance(obj, dict) else {}


@dataclass(frozen=True)
class NoAnswer:
    """A peer that gave no answer to what was asked: it did not answer in time, could not be
    reached, or refused a run-state query or a reach; `reason` says which."""

    reason: str


@dataclass(frozen=True)
class Malformed:
    """A peer answered, but not with what was asked (a run state or a reach that does not read):
    nothing is learnt from it."""

    reason: str


@dataclass(frozen=True)
class AllocationAnswer:
    """A peer's answer to an ALLOCATION: accepted, at a stage (its pipeline and stage, and the
    bytes and seconds its stage's fetch took) or as a spare; or refused, with a code and a
    reason."""

    accepted: bool
    code: str | None = None
    reason: str | None = None
    role: str | None = None  # accepted: "stage" | "spare"
    stage: int | None = None
    pipeline: int | None = None
    fetched_bytes: int = 0
    fetch_s: float = 0.0

    @classmethod
    def refused(cls, code: str, reason: str) -> AllocationAnswer:
        return cls(False, code, reason)

    def to_wire(self) -> dict:
        if not self.accepted:
            return {"accepted": False, "code": self.code, "reason": self.reason}
        if self.role != "stage":
            return {"accepted": True, "role": self.role}
        return {"accepted": True, "role": "stage", "stage": self.stage, "pipeline": self.pipeline,
                "fetched_bytes": self.fetched_bytes, "fetch_s": self.fetch_s}

    @classmethod
    def from_wire(cls, obj: object) -> AllocationAnswer:
        d = _as_map(obj)
        if not d.get("accepted"):
            return cls(False, refusal_code(d.get("code")), _text(d.get("reason")))
        role, stage, pipeline = d.get("role"), d.get("stage"), d.get("pipeline")
        if role != "stage":
            return cls(True, role=role if role == "spare" else None)
        return cls(True, role="stage", stage=stage if type(stage) is int else None,
                   pipeline=pipeline if type(pipeline) is int else None,
                   fetched_bytes=int(_amount(d.get("fetched_bytes"))), fetch_s=_amount(d.get("fetch_s")))


@dataclass(frozen=True)
class StartAnswer:
    """A peer's answer to a START."""

    started: bool
    reason: str | None = None

    def to_wire(self) -> dict:
        return {"started": self.started} if self.reason is None else {"started": self.started, "reason": self.reason}

    @classmethod
    def from_wire(cls, obj: object) -> StartAnswer:
        d = _as_map(obj)
        return cls(bool(d.get("started")), _reason(d))


@dataclass(frozen=True)
class StopAnswer:
    """A peer's answer to a STOP."""

    stopped: bool
    reason: str | None = None

    def to_wire(self) -> dict:
        return {"stopped": self.stopped} if self.reason is None else {"stopped": self.stopped, "reason": self.reason}

    @classmethod
    def from_wire(cls, obj: object) -> StopAnswer:
        d = _as_map(obj)
        return cls(bool(d.get("stopped")), _reason(d))


@dataclass(frozen=True)
class OfferAnswer:
    """A holder's answer to a RUN_STATE offer: the digest of the stage's transfer manifest and
    its size, or (no digest) why it offers nothing."""

    digest: str | None
    size: int = 0
    reason: str | None = None

    def to_wire(self) -> dict:
        if self.digest is None:
            return {"error": self.reason}
        return {"digest": self.digest, "bytes": self.size}

    @classmethod
    def from_wire(cls, obj: object) -> OfferAnswer:
        d = _as_map(obj)
        digest = d.get("digest")
        if isinstance(digest, str) and _SHA256_HEX.fullmatch(digest):
            return cls(digest, int(_amount(d.get("bytes"))))
        return cls(None, 0, _reason(d))


@dataclass(frozen=True)
class KeepAnswer:
    """A peer's answer to a RUN_STATE keep: whether it says what it kept on disk (`kept`), and
    why not all of it (`reason`)."""

    kept: bool
    reason: str | None = None

    @classmethod
    def from_wire(cls, obj: object) -> KeepAnswer:
        d = _as_map(obj)
        return cls("kept" in d, _reason(d))


# What the coordinator reads of one peer's answer (`Answers.answers`, control/actions.py).
PeerAnswer = (AllocationAnswer | StartAnswer | StopAnswer | PeerRunState | ReachAnswer | OfferAnswer | KeepAnswer
              | NoAnswer | Malformed)


def read_answer(msg: int, body: Mapping, reply: object) -> PeerAnswer:
    """A peer's `reply` to the request `msg` with `body` (this peer's own request), typed by
    what was asked; never raises on `reply` (ValueError only for a request no peer answers with
    a typed answer: a bug of the asker). A `NoAnswer` the shell made stays one."""
    if isinstance(reply, NoAnswer):
        return reply
    if msg == ControlMsg.ALLOCATION:
        return AllocationAnswer.from_wire(reply)
    if msg == ControlMsg.START:
        return StartAnswer.from_wire(reply)
    if msg == ControlMsg.STOP:
        return StopAnswer.from_wire(reply)
    if msg != ControlMsg.RUN_STATE:
        raise ValueError(f"no typed answer to message {msg}")
    op = body["op"]
    if op == "offer":
        return OfferAnswer.from_wire(reply)
    if op == "keep":
        return KeepAnswer.from_wire(reply)
    if op not in ("query", "reach"):
        raise ValueError(f"no typed answer to RUN_STATE {op!r}")
    d = _as_map(reply)
    if op == "reach" and "reached" not in d:  # (a refusal, or no reach at all: the probe hears none)
        return NoAnswer(f"refused: {_reason(d)}" if "error" in d else "no reach answer")
    if op == "query" and "error" in d and "running" not in d:
        return NoAnswer(f"refused: {_reason(d)}")
    try:
        return PeerRunState.from_wire(reply) if op == "query" else ReachAnswer.from_wire(reply)
    except ProtocolError as e:
        return Malformed(str(e)[:MAX_REASON])


def read_answers(msg: int, body: Mapping, replies: Mapping[bytes, object]) -> dict[bytes, PeerAnswer]:
    """Each peer's reply to one request, typed (`read_answer`); a malformed one is logged."""
    out = {}
    for p, reply in replies.items():
        out[p] = a = read_answer(msg, body, reply)
        if isinstance(a, Malformed):
            logger.debug("answer of %s to message %d: %s", short_id(p), msg, a.reason)
    return out
