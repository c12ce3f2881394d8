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

Peers' answers to the coordinator's requests are typed in control/answers.py, which the same
three callers use.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtfm.net import ProtocolError, get_bytes, get_dict, get_int, get_str

from .allocation import Allocation, SignedAllocation
from .answers import AllocationAnswer
from .coordinator.machine import StepFailed, StepReported
from .election import Certificate
from .epoch.access import coordinator_certificate, parse_fetchers
from .epoch.machine import StartAsked, StopAsked
from .epoch.report import StepReport
from .operator import SignedOp
from .reach import ReachRequest

__all__ = [
    "TRAIN_OPS", "Export", "Keep", "Offer", "Progress", "Query", "RunStateRequest", "TrainOp", "bad_allocation",
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


def bad_allocation(e: ProtocolError) -> AllocationAnswer:
    """The answer to an ALLOCATION that `signed_allocation` refused."""
    return AllocationAnswer.refused("bad-allocation", str(e))


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
