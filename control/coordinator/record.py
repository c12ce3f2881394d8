"""The record of the one hand-out or reconfiguration in progress (`Procedure`), its fields
grouped by the step that fills them, and the failure that ends it (`ProcedureFailed`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..allocation import Allocation
from ..answers import AllocationAnswer, OfferAnswer
from ..epoch.runstate import PeerRunState, ResumePoint
from .operator_queue import QueuedStart
from .reshape import ReshapePlan

__all__ = ["HandingOut", "Kind", "Order", "Planning", "Procedure", "ProcedureFailed", "Stopping"]


class ProcedureFailed(Exception):
    """A procedure cannot go on, with the reason."""

    def __init__(self, reason: str, *, counts: bool = True):
        super().__init__(reason)
        self.counts = counts  # toward max_reconfig_attempts


class Kind(enum.Enum):
    START = "start"  # an operator's train start: the first placement, then the hand-out
    RECONFIGURE = "reconfigure"  # a new epoch of the run in progress


@dataclass(frozen=True)
class Order:
    """What a procedure was asked to do, and for whom."""

    reply: tuple | None = None  # the operator request waiting on it
    force: bool = False  # a new layout even when the scheduler would keep this one
    retry: tuple[str, ...] = ()  # triggers to keep if it fails
    start: QueuedStart | None = None  # kind START: the operator's start
    resume: bool = False  # an operator's resume: if it fails, the run stays stopped
    leave: bool = False  # a planned leave's hand-off: recorded as a leave, not a failure


@dataclass
class Stopping:
    """The run states of the reachable peers, and the stop of the running ones."""

    asked: frozenset[bytes] = frozenset()
    running: list[bytes] = field(default_factory=list)
    states: dict[bytes, PeerRunState] = field(default_factory=dict)
    deadline: float = 0.0
    poll_at: float | None = None
    stuck: bool = False  # a step missed its deadline: abort it, do not wait for a boundary


@dataclass
class Planning:
    """Where the run resumes and its new layout, and what the holders offered."""

    rp: ResumePoint | None = None
    plan: ReshapePlan | None = None
    offers: dict[tuple[int, int], Mapping[bytes, OfferAnswer]] = field(default_factory=dict)
    left_out: frozenset[bytes] = frozenset()  # reachable peers not placed: they refused an allocation
    links_note: str = ""  # a per-link run: which links and groups compress and why (`choose_links`)
    shape_note: str = ""  # a new run: why its shape (`choose_shape`)
    rolled_back: bool = False  # the resume point is before a step completed: a rollback
    steps_lost: int = 0  # a rollback: completed (logged or reported) steps the swarm runs again


@dataclass
class HandingOut:
    """The allocation handed out and its answers."""

    alloc: Allocation | None = None
    answers: Mapping[bytes, AllocationAnswer] = field(default_factory=dict)
    refused: str = ""
    transient: bool = False  # every refusal of the hand-out was a membership disagreement


@dataclass
class Procedure:
    """The one hand-out or reconfiguration in progress."""

    id: int
    kind: Kind
    trigger: str
    order: Order
    t0: float
    cur: Allocation | None = None
    tries: int = 0  # kind START: hand-outs placed again without peers that refused
    place_at: float | None = None  # kind START: when to try the first placement again (peers unmeasured)
    marks: dict[str, float] = field(default_factory=dict)
    stop: Stopping = field(default_factory=Stopping)
    planning: Planning = field(default_factory=Planning)
    hand: HandingOut = field(default_factory=HandingOut)
