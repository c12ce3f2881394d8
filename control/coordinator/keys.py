"""The keys of the coordinator's requests (`Ask`, `Compute`): which part of the machine an answer
goes back to, as a closed set of frozen types (the machine routes an `Answers` or `Computed` by
the key's type, never by reading a string in it).

Each key prints as the transcripts name the request (tests/machine_trace.py): a procedure's by
its step ("states", "offer 0-4"), the others by their kind and number ("probe epoch",
"opstop 1", "keep 2", "gaps 3", "fence 1", "drift").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Drift", "Fence", "Gaps", "JoinPlan", "Keep", "OperatorStop", "Probe", "ProbeKey", "ProcStep", "RequestKey", "Step"]


class Step(enum.Enum):
    """A step of the procedure in progress (procedure.py), as its request names it."""

    FIRST = "first"  # a start's first placement (the scheduler, `Compute`)
    STATES = "states"  # the run states of every reachable peer
    STOP = "stop"  # STOP of the running peers at a common step boundary (or aborting the step)
    POLL = "poll"  # the run states again, until the running peers stopped
    FINAL = "final"  # the run states once the stop's time is up
    PLAN = "plan"  # the new layout (the scheduler, `Compute`)
    OFFER = "offer"  # the holders of one stage offer it at the resume step
    ALLOC = "alloc"  # ALLOCATION to every named peer
    UNSTOP = "unstop"  # a refused hand-out: STOP of the epoch to the peers that accepted it
    START = "start"  # START of the accepted epoch


class Probe(enum.Enum):
    """What the run watch (watch.py) asks the peers while no procedure runs; one at a time."""

    EPOCH = "epoch"  # re-elected: does the epoch it handed out still run everywhere?
    FAILED = "failed"  # a failed step was reported: do the run states agree?
    HOLDERS = "holders"  # a paused run: do the peers out of reach answer again?
    JOINED = "joined"  # live peers outside the run: do they answer, measured?
    DRIFT = "drift"  # the scheduler on the measured network (a `Compute`, not an `Ask`)
    JOINS = "joins"  # the scheduler with a wave of joined peers: is the run faster with them? (a `Compute`)
    DEADLINE = "deadline"  # an overdue step: do its laggards answer and reach their neighbours?
    LINKS = "links"  # cut links: does a ping over each come back?


@dataclass(frozen=True)
class ProcStep:
    """A request of procedure `proc` at `step`; `layers`: the stage an OFFER is for."""

    proc: int
    step: Step
    layers: tuple[int, int] | None = None

    def __str__(self) -> str:
        return self.step.value if self.layers is None else f"{self.step.value} {self.layers[0]}-{self.layers[1]}"


@dataclass(frozen=True)
class ProbeKey:
    kind: Probe

    def __str__(self) -> str:
        return f"probe {self.kind.value}"


@dataclass(frozen=True)
class Gaps:
    """The run states asked for the reports of steps the step log of `epoch` misses."""

    epoch: int

    def __str__(self) -> str:
        return f"gaps {self.epoch}"


@dataclass(frozen=True)
class OperatorStop:
    """The final STOP of an operator's stop, the `n`th request of the machine."""

    n: int

    def __str__(self) -> str:
        return f"opstop {self.n}"


@dataclass(frozen=True)
class Drift:
    """The scheduler run on the measured network to see whether a faster allocation exists."""

    def __str__(self) -> str:
        return "drift"


@dataclass(frozen=True)
class JoinPlan:
    """The scheduler run with a wave of joined peers live (`peers`), before anything stops: a
    reconfiguration only when the run is faster with them."""

    peers: tuple[bytes, ...]
    trigger: str

    def __str__(self) -> str:
        return "joins"


@dataclass(frozen=True)
class Fence:
    """The aborting STOP sent to the peers of `epoch` that missed a deadline and its probe."""

    epoch: int

    def __str__(self) -> str:
        return f"fence {self.epoch}"


@dataclass(frozen=True)
class Keep:
    """The `n`th request that the peers of a waiting run keep what they hold on disk."""

    n: int

    def __str__(self) -> str:
        return f"keep {self.n}"


RequestKey = ProcStep | ProbeKey | Gaps | OperatorStop | Drift | JoinPlan | Fence | Keep
