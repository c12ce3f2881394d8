"""The coordinator's step log: its record of the epoch it handed out (see docs/control.md).

Every peer of the epoch reports each step (STEP); once a step has every report, or a later step
has every report, its line is complete. A step whose reports were all lost is a gap,
back-filled from the reports the peers keep; steps before the resume point of a new epoch are
back-filled at its hand-out. `StepLog` only returns the lines: the plane's shell stamps them
with the wall time and appends them to the run's log file.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..allocation import Allocation
from ..epoch.runner import StepReport

__all__ = ["MAX_RECENT_STEPS", "StepLog"]

MAX_RECENT_STEPS = 64  # lines kept for `status`


class StepLog:
    """The coordinator's record of one epoch it handed out: the step reports and the lines they
    complete. `logged` is shared by the epochs of one run (the steps already written)."""

    def __init__(self, alloc: Allocation, logged: set[int], *, started_at: float):
        self.alloc = alloc
        self.reports: dict[int, dict[bytes, StepReport]] = {}
        self.completed = alloc.start_step - 1
        self.logged = logged
        self.recent: list[dict] = []
        self.started_at = started_at
        self.fetched = 0  # bytes the peers fetched to take on their stages
        self.fetch_s = 0.0  # the slowest peer's fetch
        self.gaps: set[int] = set()  # completed steps of which no report arrived
        self.filling = False  # the peers are being asked for the gaps' reports

    @property
    def finished(self) -> bool:
        return self.completed + 1 >= self.alloc.end_step

    def add(self, peer: bytes, rep: StepReport) -> list[dict]:
        """Record a report; the lines of the steps it completes. Every peer reports each step,
        and peers step together: once a later step has every report, an earlier one whose
        report was lost is logged with the reports it has (`partial`); a step with no report at
        all is passed over into `gaps`, to be filled from the reports the peers keep (`fill`)."""
        if rep.epoch != self.alloc.epoch or rep.step <= self.completed or peer not in self.alloc.peers:
            return []
        self.reports.setdefault(rep.step, {})[peer] = rep
        n, lines = len(self.alloc.peers), list[dict]()
        while True:
            step = self.completed + 1
            got = self.reports.get(step, {})
            if len(got) < n and not any(len(r) == n for s, r in self.reports.items() if s > step):
                return lines
            self.reports.pop(step, None)
            self.completed = step
            if got:
                lines.append(self._line(step, list(got.values()), self.alloc.epoch, partial=len(got) < n))
            else:
                self.gaps.add(step)

    def backfill(self, reports: Iterable[StepReport], steps: Iterable[int]) -> list[dict]:
        """Lines for those of `steps` not logged yet, from the peers' own reports, marked
        `backfilled`: each from the reports of its newest epoch (a step re-run after a
        rollback: its last run). Steps no report covers are left out."""
        by_step: dict[int, list[StepReport]] = {}
        for r in reports:
            by_step.setdefault(r.step, []).append(r)
        lines = []
        for step in sorted(set(steps) - self.logged):
            got = by_step.get(step)
            if got:
                newest = max(r.epoch for r in got)
                lines.append(self._line(step, [r for r in got if r.epoch == newest], newest, backfilled=True))
        return lines

    def fill(self, reports: Iterable[StepReport]) -> tuple[list[dict], list[int]]:
        """Lines for the gaps these reports (the peers' own, of any step) cover with this
        epoch's reports, and the gaps they leave (given up here; a later epoch's back-fill may
        still find them)."""
        lines = self.backfill([r for r in reports if r.epoch == self.alloc.epoch], self.gaps)
        left = sorted(self.gaps - self.logged)
        self.gaps.clear()
        return lines, left

    def _line(self, step: int, reports: list[StepReport], epoch: int, backfilled: bool = False,
              partial: bool = False) -> dict:
        losses = [r.loss for r in reports if r.loss is not None]

        def most(key: str) -> float | None:
            return max((getattr(r, key) for r in reports), default=None)
        iteration_s = most("iteration_s")
        tokens = self.alloc.train.global_batch_seqs * self.alloc.model.seq_len
        line: dict = {"step": step, "loss": losses[0] if losses else None, "epoch": epoch, "term": self.alloc.term,
                      "iteration_s": iteration_s, "tokens_per_s": tokens / iteration_s if iteration_s else None,
                      "predicted_iteration_s": self.alloc.predicted_iteration_s,
                      "compute_s": most("compute_s"), "pipeline_s": most("pipeline_s"), "sync_s": most("sync_s")}
        if partial:
            line["partial"] = True
        if backfilled:
            line["backfilled"] = True
        self.logged.add(step)
        self.recent = (self.recent + [line])[-MAX_RECENT_STEPS:]
        return line
