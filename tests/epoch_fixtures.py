"""The shell around one peer's epoch machine that the epoch machine's tests play
(tests/control/epoch/test_epoch_machine.py, and tests/transcripts.py for tests/data/epoch/): `Peer` drives the
machine under an election the test sets and keeps what it did as transcript lines
(tests/machine_trace.py writes them)."""

from __future__ import annotations

from machine_trace import OPERATOR, OPERATORS, RUN, FakeElection, N, context, describe, show

from dtfm.control import Allocation, sign_op
from dtfm.control.actions import Reply
from dtfm.control.epoch.machine import (
    AllocationOffered,
    ApplyToElection,
    BuildStage,
    EpochMachine,
    StageBuilt,
    StartAsked,
)

HEARTBEAT_WAIT_S = 1.4
LOST_AFTER_S = 6.0
STOP = sign_op(OPERATOR, "stop", now_s=3.0, run_id=RUN)  # the operator's stop of RUN


class Peer:
    """One peer's epoch machine under an election the test sets, playing the shell's part for
    ApplyToElection (the election takes the applied (term, epoch) and voters); everything the
    machine did is in `lines`."""

    def __init__(self, me: bytes = N[1], *, coordinator: bytes | None = N[0], term: int = 1):
        self.me = me
        self.election = FakeElection(me, term=term, coordinator=coordinator, voters=tuple(N[:4]))
        self.m = EpochMachine(me, self.election, heartbeat_wait_s=HEARTBEAT_WAIT_S,
                              coordinator_lost_after_s=LOST_AFTER_S, operators=OPERATORS)
        self.lines: list[str] = []
        self._keys = 0

    def key(self, what: str) -> tuple:
        self._keys += 1
        return (what, self._keys)

    def feed(self, event, now: float = 0.0) -> list:
        actions = self.m.handle(event, now)
        self.lines.append(f"{now:g} {describe(event)}")
        for a in actions:
            if isinstance(a, ApplyToElection):
                self.election.apply(a)
            if isinstance(a, Reply):  # the answer to this event's request
                assert a.key == event.key, (a, event)
            self.lines.append("  " + show(a, keys=False))
        return actions

    def offer(self, a: Allocation, now: float = 0.0, **ctx) -> list:
        return self.feed(AllocationOffered(self.key("a"), a, context(self.me, **ctx)), now)

    def accept(self, a: Allocation, now: float = 0.0) -> None:
        """Offered, built at its start step and started by its issuer."""
        [build] = [x for x in self.offer(a, now) if isinstance(x, BuildStage)]
        self.feed(StageBuilt(build.key, a.epoch, a.start_step), now)
        self.feed(StartAsked(self.key("s"), a.issuer, a.run_id, a.epoch), now)
