"""What the coordinator counted of the runs it coordinated, for `/metrics` and `status`: steps
logged, reconfigurations, rollbacks, the completed steps run again after them, the completed
steps that could not be logged (no peer kept a report of them), and when the last step was
logged. Counted by this daemon since it started (a Prometheus counter starts again with
its process); per run, so a later run starts from zero.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["RunCounters", "RunCounts"]


@dataclass(frozen=True)
class RunCounts:
    """One run's counts at this coordinator."""

    run_id: bytes
    steps: int = 0  # step lines logged (back-filled ones included)
    reconfigurations: int = 0  # epochs handed out after the first (rollbacks and leaves included)
    rollbacks: int = 0  # reconfigurations that ran logged steps again
    steps_lost: int = 0  # completed steps the rollbacks ran again
    last_step_at: float | None = None  # wall time of the last step line logged (not back-filled)
    steps_unlogged: int = 0  # completed steps given up by the step log: no peer kept a report of them

    def to_wire(self) -> dict:
        return {"steps": self.steps, "reconfigurations": self.reconfigurations, "rollbacks": self.rollbacks,
                "steps_lost": self.steps_lost, "last_step_at": self.last_step_at,
                "steps_unlogged": self.steps_unlogged}


class RunCounters:
    """The counts of the run this coordinator coordinates (a new run id starts them again)."""

    def __init__(self) -> None:
        self.current: RunCounts | None = None

    def _of(self, run_id: bytes) -> RunCounts:
        if self.current is None or self.current.run_id != run_id:
            self.current = RunCounts(run_id)
        return self.current

    def logged(self, run_id: bytes, lines: int, at: float | None) -> None:
        """`lines` step lines logged; `at`: the wall time of a fresh step among them (None: back-fill only)."""
        c = self._of(run_id)
        self.current = replace(c, steps=c.steps + lines, last_step_at=at if at is not None else c.last_step_at)

    def reconfigured(self, run_id: bytes, *, rollback: bool, steps_lost: int) -> None:
        c = self._of(run_id)
        self.current = replace(c, reconfigurations=c.reconfigurations + 1, rollbacks=c.rollbacks + rollback,
                               steps_lost=c.steps_lost + steps_lost)

    def unlogged(self, run_id: bytes, steps: int) -> None:
        """`steps` completed steps the step log gave up (no peer kept a report of them)."""
        c = self._of(run_id)
        self.current = replace(c, steps_unlogged=c.steps_unlogged + steps)
