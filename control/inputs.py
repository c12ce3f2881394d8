"""The plane's input layer: what a peer sends the control plane, decoded and checked once.

Every message body that reaches the plane's machines passes through one function here, which
checks every field (type, range, length) and returns the typed event a machine takes
(`StartAsked`, `StopAsked`, `StepReported`, `StepFailed`, an allocation with its certificate),
or the typed request the shell answers (RUN_STATE's six), and raises `ProtocolError` for
anything malformed, before any machine sees it. Pure: no socket, clock, file or thread.

The daemon's shell (control/plane.py), the simulation (control/testing/sim.py) and the
coordinator's test fixture all call these functions, so the simulation exercises the daemon's
own checks, not a copy of them.

A STOP or a RUN_STATE offer may carry the certificate of the sender's election
(`coordinator_certificate`): a holder outside the council hears no heartbeats, so it may not
know a coordinator elected since its last allocation. The certificate to pass to the election
(`learn`, which checks it against this peer's council) before the machines read the request
is the one of a sender this peer does not recognise as coordinator yet (`to_learn`).

Peers' answers to the coordinator's requests are typed here too (`AllocationAnswer`,
`StartAnswer`, `StopAnswer`, `OfferAnswer`): their `from_wire` reads any map, never raising,
as the coordinator reads an untrusted answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dtfm.net import ProtocolError, get_bytes, get_dict, get_int, get_str

from .allocation import Allocation, SignedAllocation
from .coordinator.links import ReachRequest
from .coordinator.machine import StepFailed, StepReported
from .election import Certificate
from .epoch.access import coordinator_certificate, parse_fetchers
from .epoch.machine import StartAsked, StopAsked
from .epoch.report import StepReport
from .operator import SignedOp

__all__ = [
    "TRAIN_OPS", "AllocationAnswer", "Export", "Keep", "Offer", "OfferAnswer", "Progress", "Query", "RunStateRequest",
    "StartAnswer", "StopAnswer", "TrainOp", "bad_allocation", "refusal_code",
    "leave_request", "run_state_request", "signed_allocation", "start_asked", "step_message", "stop_asked",
    "to_learn", "train_op",
]

TRAIN_OPS = ("start", "stop", "reschedule", "resume", "root")  # what a peer may forward (TRAIN_OP)
MAX_STEP = 2**63 - 1
MAX_AFTER = 2**62  # a progress request's `after` (a step number, or the largest: no lines)


def _non_negative(v: object, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ProtocolError(f"{what} must be a non-negative integer")
    return v


def _map(body: object, what: str) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(f"{what} body must be a map")
    return body


def to_learn(certificate: Certificate | None, sender: bytes, coordinator: bytes | None) -> Certificate | None:
    """The certificate a request carried that the election should learn before the request is
    handled: one of a sender that is not the coordinator this peer recognises; else None."""
    if certificate is None or sender == coordinator:
        return None
    return certificate


# ---- the epoch machine's requests -----------------------------------------------------------


def start_asked(key: tuple, sender: bytes, body: object) -> StartAsked:
    """A START request (its run and epoch are compared by the machine, whatever their type)."""
    d = _map(body, "START")
    return StartAsked(key, sender, d.get("run"), d.get("epoch"))


def stop_asked(key: tuple, sender: bytes, body: object, *, current_run: bytes | None,
               coordinator: bytes | None) -> tuple[StopAsked, Certificate | None]:
    """A STOP request as the epoch machine takes it, and the certificate to learn first
    (`to_learn`). `at_step` is checked for a STOP of the run this peer is in (`current_run`);
    another run's STOP stops nothing here, and its step is read as 0."""
    d = _map(body, "STOP")
    at = _non_negative(d.get("at_step"), "STOP at_step") if current_run is not None and d.get("run") == current_run \
        else 0
    op = SignedOp.from_wire(d["op"]) if d.get("op") is not None else None
    cert = coordinator_certificate(sender, d)
    epoch = d.get("epoch")
    if epoch is not None:
        epoch = _non_negative(epoch, "STOP epoch")
    ev = StopAsked(key, sender, d.get("run"), at, final=d.get("final") is True, abort=d.get("abort") is True,
                   op=op, epoch=epoch)
    return ev, to_learn(cert, sender, coordinator)


# ---- the coordinator's one-way message ------------------------------------------------------


def step_message(sender: bytes, body: object) -> StepReported | StepFailed:
    """A STEP message: a step's report, or (`failed`) why this peer's step failed."""
    d = _map(body, "STEP")
    if "failed" in d:
        reason = d.get("failed")
        if not isinstance(reason, str):
            raise ProtocolError("STEP failed must be a string")
        return StepFailed(sender, d.get("run"), d.get("epoch"), reason)
    return StepReported(sender, d.get("run"), StepReport.from_wire(d))


# ---- an allocation --------------------------------------------------------------------------


def signed_allocation(body: object) -> tuple[Allocation, Certificate | None]:
    """An ALLOCATION: the allocation (its signature checked) and the certificate of its
    issuer's election carried beside it, if any."""
    alloc = SignedAllocation.from_wire(body).open()
    d = _map(body, "ALLOCATION")  # (from_wire refused anything else)
    return alloc, Certificate.from_wire(d["cert"]) if "cert" in d else None


def bad_allocation(e: ProtocolError) -> dict:
    """The answer to an ALLOCATION that `signed_allocation` refused."""
    return AllocationAnswer.refused("bad-allocation", str(e)).to_wire()


# ---- RUN_STATE ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """What this peer holds of its run (`PeerRunState`)."""


@dataclass(frozen=True)
class Progress:
    """A coordinator's account of its run (`run`: the run asked about; None: its own), with the
    step lines after step `after`."""

    run: bytes | None
    after: int


@dataclass(frozen=True)
class Export:
    """An operator's export's request; control/export.py checks its fields (the signed export
    among them) when it answers."""

    body: dict


@dataclass(frozen=True)
class Keep:
    """The run waits: what this peer holds of run `run_id` in memory goes to its data dir."""

    run_id: bytes


@dataclass(frozen=True)
class Offer:
    """Offer the stage of run `run_id` with `layers` at `step` to `fetchers` (the peers the
    next allocation names); `learn`: the certificate to learn first (`to_learn`)."""

    run_id: bytes
    step: int
    layers: tuple[int, int]
    fetchers: frozenset[bytes]
    learn: Certificate | None = None


RunStateRequest = Query | Progress | ReachRequest | Export | Keep | Offer


def run_state_request(sender: bytes, body: object, *, coordinator: bytes | None) -> RunStateRequest:
    """A RUN_STATE request, by its `op`: query, progress, reach, export, keep or offer."""
    d = get_dict(body, "RUN_STATE")
    op = get_str(d, "op", 16)
    if op == "query":
        return Query()
    if op == "progress":
        run = get_bytes(d, "run", 16, 16) if d.get("run") is not None else None
        return Progress(run, get_int(d, "after", -1, MAX_AFTER))
    if op == "reach":
        return ReachRequest.from_wire(d)
    if op == "export":
        return Export(d)
    if op == "keep":
        return Keep(get_bytes(d, "run", 16, 16))
    if op != "offer":
        raise ProtocolError(f"RUN_STATE: unknown op {op!r}")
    run_id = get_bytes(d, "run", 16, 16)
    step = get_int(d, "step", 0, MAX_STEP)
    layers = d.get("layers")
    if not isinstance(layers, list) or len(layers) != 2 or not all(type(x) is int for x in layers):
        raise ProtocolError("RUN_STATE: layers must be [first, end]")
    fetchers = parse_fetchers(d)
    cert = coordinator_certificate(sender, d)
    return Offer(run_id, step, (layers[0], layers[1]), fetchers, to_learn(cert, sender, coordinator))


# ---- a peer's leave and an operator's forwarded operation -----------------------------------


def leave_request(body: object) -> None:
    """A LEAVE: an empty map (the leaving peer is the connection's authenticated peer)."""
    get_dict(body, "LEAVE")


@dataclass(frozen=True)
class TrainOp:
    """An operator's operation forwarded by a peer (TRAIN_OP): its kind and the signed
    operation (None: the sender's version does not sign it; refused by the shell)."""

    op: str
    signed: SignedOp | None


def train_op(body: object) -> TrainOp:
    d = get_dict(body, "TRAIN_OP")
    op = get_str(d, "op", 16)
    if op not in TRAIN_OPS:
        raise ProtocolError(f"TRAIN_OP: unknown op {op!r}")
    return TrainOp(op, SignedOp.from_wire(d["signed"]) if "signed" in d else None)


# ---- peers' answers to the coordinator ------------------------------------------------------
#
# What a peer answers to the coordinator's ALLOCATION, START, STOP and RUN_STATE offer, typed.
# `from_wire` never raises: an answer is untrusted, and a malformed one reads as what a
# coordinator makes of it (no acceptance, no offer, no code: "malformed"), the same reading
# as the coordinator's of the wire maps. A peer that did not answer in time is a map with only
# `reason` (the shell's), which reads as a refusal without a code.

MAX_REASON = 512  # characters of a peer's reason kept
_CODE = re.compile(r"[a-z][a-z-]{0,31}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def refusal_code(v: object) -> str | None:
    """A refusing peer's code (untrusted: a short lower-case word), "malformed" for any other
    value, None when it gave none (it did not answer in time)."""
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


def _reason(d: dict) -> str | None:
    v = d.get("error", d.get("reason"))
    return None if v is None else str(v)[:MAX_REASON]


def _as_map(obj: object) -> dict:
    return obj if isinstance(obj, dict) else {}


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
            return cls(False, refusal_code(d.get("code")),
                       None if d.get("reason") is None else str(d.get("reason"))[:MAX_REASON])
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

