"""The plane's events (events.jsonl, `dtfm-swarm events`) and a reconfiguration's record
(`last_reconfig` in status): frozen dataclasses with their kinds as an enum, serialised in
one place (`to_wire`). See docs/control.md.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from dtfm.net import short_id

__all__ = ["EventKind", "LeftOutPeer", "PlaneEvent", "Reconfiguration"]


class EventKind(enum.Enum):
    COORDINATOR = "coordinator"  # this peer was elected
    STEPPED_DOWN = "stepped-down"
    START = "start"  # a run's first epoch was handed out
    RECONFIGURE = "reconfigure"
    ROLLBACK = "rollback"  # a reconfiguration that runs logged steps again
    PAUSED = "paused"  # some stage has no reachable holder
    STOPPED = "stopped"  # the run cannot go on
    OPERATOR_STOP = "operator-stop"  # an operator's `train stop`: every peer ends before one step
    FINISHED = "finished"  # the run completed its last step
    LEAVE = "leave"  # a peer left as planned (`dtfm-peer leave`), handed off at a step boundary if the run named it
    LEFT_OUT = "left-out"  # peers refused a hand-out the others accepted: the next attempts go on without them
    UNLOGGED = "unlogged"  # completed steps the step log cannot log: no peer keeps a report of them


@dataclass(frozen=True)
class Reconfiguration:
    """What one reconfiguration did, and how long each of its phases took."""

    at: float  # wall time it completed
    reason: str  # its trigger
    epoch: int
    term: int
    old_shape: str  # "SxD"
    new_shape: str
    kind: str  # the reshape kind: keep, repair, shrink, grow, reschedule, restage
    predicted_old_s: float
    predicted_new_s: float
    moves: int
    bytes_moved: int
    resume_step: int
    rollback: bool
    started_at: float  # wall time
    stop_s: float
    schedule_s: float
    offer_s: float
    transfer_s: float
    handout_s: float
    compress_links: str = ""  # a per-link run: which links and DP groups compress, and why
    restored_from: str = "memory"  # the costliest source a stage came from: memory, checkpoint or initial
    steps_lost: int = 0  # a rollback: completed steps the swarm runs again

    def to_wire(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if not self.compress_links:
            del out["compress_links"]
        return out


@dataclass(frozen=True)
class LeftOutPeer:
    """One refusing peer as `status` and the events show it (wall times; control/coordinator/leftout.py
    keeps them)."""

    peer: bytes
    code: str  # its refusal's code, or "no-answer"
    reason: str  # its refusal's words (a peer's own: bounded, shown as given)
    since: float  # when it was left out
    until: float  # placed again from then on
    refusals: int  # refusals in a row (its back-off doubles with each)

    def describe(self, now: float | None = None) -> str:
        """Who refused and why; with `now`, for how much longer it is left out."""
        out = f"{short_id(self.peer)} refused ({self.code}: {self.reason[:200]})"
        if now is not None:
            out += f", left out for {max(0.0, self.until - now):.0f} s more"
        return out + (f" ({self.refusals} refusals in a row)" if self.refusals > 1 else "")

    def to_wire(self) -> dict:
        return {"peer": self.peer.hex(), "code": self.code, "reason": self.reason, "since": self.since,
                "until": self.until, "refusals": self.refusals}


@dataclass(frozen=True)
class PlaneEvent:
    """One line of events.jsonl (the shell adds the time and this peer's id)."""

    kind: EventKind
    term: int
    trigger: str
    epoch: int | None = None
    reason: str | None = None  # why a run paused or stopped
    start_shape: str | None = None  # START: "SxD"
    start_predicted_s: float | None = None  # START: the predicted iteration time
    reconfiguration: Reconfiguration | None = None  # RECONFIGURE, ROLLBACK
    compress_links: str | None = None  # START of a per-link run: which links and DP groups compress, and why
    shape_note: str | None = None  # START: why this shape (the scheduler's prediction against the shapes tried)
    left_out: tuple[LeftOutPeer, ...] = ()  # LEFT_OUT, STOPPED: the refusing peers left out, and why
    steps: tuple[int, ...] = ()  # UNLOGGED: the steps


    def to_wire(self) -> dict[str, Any]:
        if self.reconfiguration is not None:
            rec = self.reconfiguration.to_wire()
            return {"trigger": self.trigger, **{k: v for k, v in rec.items() if k not in ("at", "reason")}}
        out: dict[str, Any] = {"term": self.term}
        if self.epoch is not None:
            out["epoch"] = self.epoch
        out["trigger"] = self.trigger
        if self.kind is EventKind.START:
            out.update(old_shape=None, new_shape=self.start_shape, predicted_new_s=self.start_predicted_s, moves=0,
                       bytes_moved=0, resume_step=0)
        if self.reason is not None:
            out["reason"] = self.reason
        if self.compress_links is not None:
            out["compress_links"] = self.compress_links
        if self.shape_note is not None:
            out["shape_note"] = self.shape_note
        if self.left_out:
            out["left_out"] = [x.to_wire() for x in self.left_out]
        if self.steps:
            out["steps"] = list(self.steps)
        return out
