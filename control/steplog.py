"""The coordinator's step log: its record of the epoch it handed out.

Every peer of the epoch reports each step (STEP); once a step has every report, or a later step
has every report, the coordinator appends its line to `DATA_DIR/train.jsonl` (loss, epoch, term,
step times). A step whose reports were all lost is a gap, back-filled from the reports the
peers keep; steps before the resume point of a new epoch are back-filled at its hand-out.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

from .allocation import Allocation
from .epoch.runner import StepReport

logger = logging.getLogger("dtfm.control.plane")  # one log for the whole control plane

MAX_RECENT_STEPS = 64  # lines kept for `status`


class _Issued:
    """The coordinator's record of the epoch it handed out: step reports and the training log."""

    def __init__(self, alloc: Allocation, log_path: Path, logged: set[int]):
        self.alloc = alloc
        self.log_path = log_path
        self.reports: dict[int, dict[bytes, StepReport]] = {}
        self.completed = alloc.start_step - 1
        self.logged = logged  # steps of this run this peer wrote to its log
        self.recent: list[dict] = []
        self.state = "handing out"
        self.reason = ""
        self.started_at = time.time()
        self.fetched = 0  # bytes the peers fetched to take on their stages
        self.fetch_s = 0.0  # the slowest peer's fetch
        self.gaps: set[int] = set()  # completed steps of which no report arrived
        self.filling = False  # the peers are being asked for the gaps' reports

    def add(self, peer: bytes, rep: StepReport) -> list[dict]:
        """Record a report; the lines of the steps it completes. Every peer reports each step,
        and peers step together: once a later step has every report, an earlier one whose
        report was lost is logged with the reports it has (`partial`); a step with no report at
        all is passed over into `gaps`, filled from the reports the peers keep (`fill_gaps`)."""
        if rep.epoch != self.alloc.epoch or rep.step <= self.completed or peer not in self.alloc.peers:
            return []
        self.reports.setdefault(rep.step, {})[peer] = rep
        n, lines = len(self.alloc.peers), []
        while True:
            step = self.completed + 1
            got = self.reports.get(step, {})
            if len(got) < n and not any(len(r) == n for s, r in self.reports.items() if s > step):
                return lines
            self.reports.pop(step, None)
            self.completed = step
            if got:
                lines.append(self.write(step, list(got.values()), self.alloc.epoch, partial=len(got) < n))
            else:  # every report of it lost: the peers are asked for the reports they keep
                logger.warning("no report of step %d arrived; asking the peers for theirs", step)
                self.gaps.add(step)

    def backfill(self, reports: Iterable[StepReport], steps: Iterable[int]) -> list[dict]:
        """Log those of `steps` not logged yet from the peers' own reports, marked `backfilled`:
        each from the reports of its newest epoch (a step re-run after a rollback: its last
        run). Steps no report covers are left out. Returns the lines."""
        by_step: dict[int, list[StepReport]] = {}
        for r in reports:
            by_step.setdefault(r.step, []).append(r)
        lines = []
        for step in sorted(set(steps) - self.logged):
            got = by_step.get(step)
            if got:
                newest = max(r.epoch for r in got)
                lines.append(self.write(step, [r for r in got if r.epoch == newest], newest, backfilled=True))
        return lines

    def fill(self, reports: Iterable[StepReport]) -> list[dict]:
        """Log the gaps these reports (the peers' own, of any step) cover with this epoch's
        reports; gaps they do not cover are given up here (a later epoch's back-fill may still
        find them)."""
        lines = self.backfill([r for r in reports if r.epoch == self.alloc.epoch], self.gaps)
        for step in sorted(self.gaps - self.logged):
            logger.warning("no peer kept a report of step %d; a later epoch may back-fill it", step)
        self.gaps.clear()
        return lines

    def write(self, step: int, reports: list[StepReport], epoch: int, backfilled: bool = False,
              partial: bool = False) -> dict:
        losses = [r.loss for r in reports if r.loss is not None]

        def most(key: str) -> float | None:
            return max((getattr(r, key) for r in reports), default=None)
        iteration_s = most("iteration_s")
        tokens = self.alloc.train.global_batch_seqs * self.alloc.model.seq_len
        line = {"step": step, "loss": losses[0] if losses else None, "epoch": epoch, "term": self.alloc.term,
                "iteration_s": iteration_s, "tokens_per_s": tokens / iteration_s if iteration_s else None,
                "predicted_iteration_s": self.alloc.predicted_iteration_s,
                "compute_s": most("compute_s"), "pipeline_s": most("pipeline_s"), "sync_s": most("sync_s"),
                "time": time.time()}
        if partial:
            line["partial"] = True
        if backfilled:
            line["backfilled"] = True
        self.logged.add(step)
        self.recent = (self.recent + [line])[-MAX_RECENT_STEPS:]
        with open(self.log_path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return line
