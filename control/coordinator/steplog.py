"""The coordinator's step log: its record of the epoch it handed out (see docs/control.md).

Every peer of the epoch reports each step (STEP). Step s is complete once every peer reported
it, or a later step (`REORDER_STEPS` later when no report of a last stage of s came: reports
may come out of order); and, since a peer that reports a step has completed every step before it,
once every peer reported step s + STEP_WINDOW - 1, the last of the window after s (a report
lost, or later than that, is not waited for), or the epoch's last step. Its line then carries the reports it has
(`partial` when some are missing). A step no report of a last stage of which came (all lost: its line would have no loss) is then a
gap, back-filled from the reports the peers keep (`fill`, from their RUN_STATE answers); steps
before the resume point of a new epoch are back-filled at its hand-out, and those its answers
did not cover stay gaps of the new epoch's log (`carry`). A gap is asked for again while some
peer does not answer: at once up to `GAP_ATTEMPTS` times, then spaced (doubling up to
`GAP_RETRY_MAX` times the check interval), until a report covers it; it is given up only when
it cannot be recovered: every peer asked answered and none kept a report of it, or it is older
than any peer keeps (`MAX_REPORTS` steps behind) or than the newest `MAX_GAPS` gaps. A step
given up is never a silent hole: `take_lost` hands it to the coordinator, which logs, counts
and records it (event `unlogged`). `StepLog` only returns the lines: the plane's shell stamps
them with the wall time and appends them to the run's log file.

What a peer may report (each refusal counted in the coordinator's `Refusals`):

- only a peer with a stage in the epoch, only for that epoch, and each step once;
- only steps after the last completed one and at most `STEP_WINDOW` beyond it (peers are within
  a step of each other): a report further ahead still counts as that peer's progress (one
  number per peer), but what it says is not kept, so the state is at most `STEP_WINDOW` steps of
  reports, and no work grows with what a peer sends;
- bytes sent per axis (each report's own, bounded by `StepReport.from_wire`): the line's
  `bytes_sent` (pipeline forward, pipeline backward, data-parallel, other) is their sum over the
  reports it has (every peer's unless the line is `partial`);
- the loss only from the last-stage peers: their losses are one global value (summed in pipeline
  order on every last stage), so they are compared; a disagreement is logged at WARNING and the
  line says so (`loss_disagreement`: each last-stage peer's loss), and the line's loss is the
  value a strict majority of the last stages that gave one give; with no such majority (a tie:
  with two pipelines, one last stage against the other) no loss is logged: the line's loss is
  null and it says `loss_no_majority`, so no single last stage writes the loss.

Back-filled reports (the peers' own, from their run states) are checked the same way against
the allocation of their epoch, when this peer knows it (`known`); a report of an epoch it does
not know, or outside its epoch's steps, is left out. While some peer has not answered (and
attempts remain), a gap no last stage's report covers waits for one rather than being logged
without a loss.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping

from dtfm.net import short_id

from ..allocation import Allocation
from ..epoch.report import BYTE_AXES, StepReport
from ..epoch.runstate import MAX_REPORTS
from ..refusals import Refusals, Refused

__all__ = ["GAP_ATTEMPTS", "GAP_RETRY_MAX", "MAX_GAPS", "MAX_RECENT_STEPS", "REORDER_STEPS", "STEP_WINDOW", "StepLog"]

logger = logging.getLogger(__name__)

MAX_RECENT_STEPS = 64  # lines kept for `status`
# Reports are kept for completed < step <= completed + STEP_WINDOW. Peers step within one step of
# each other, but their reports reach the coordinator over links that may be slower than a step
# (the coordinator's own report arrives at once): its view may lag a few steps behind the peers.
STEP_WINDOW = 8
REORDER_STEPS = 3  # a step whose last stages' reports have not come waits until a step this much later is complete
MAX_GAPS = MAX_REPORTS  # gaps kept for filling: a peer keeps no more reports than this
GAP_ATTEMPTS = 4  # queries for the gaps' reports at once while some peer does not answer; then spaced
GAP_RETRY_MAX = 16  # the spaced queries' longest wait, in check intervals (doubling from one)

Known = Callable[[int], "Allocation | None"]  # epoch -> its allocation, if this peer knows it


class StepLog:
    """The coordinator's record of one epoch it handed out: the step reports and the lines they
    complete. `logged` is shared by the epochs of one run (the steps already written)."""

    def __init__(self, alloc: Allocation, logged: set[int], *, started_at: float,
                 refusals: Refusals | None = None, known: Known | None = None):
        self.alloc = alloc
        self.reports: dict[int, dict[bytes, StepReport]] = {}  # completed < step <= completed + STEP_WINDOW
        self.completed = alloc.start_step - 1
        self.logged = logged
        self.recent: list[dict] = []
        self.started_at = started_at
        self.fetched = 0  # bytes the peers fetched to take on their stages
        self.fetch_s = 0.0  # the slowest peer's fetch
        # completed steps not logged yet (no report of them, or of a last stage, arrived; or steps
        # an earlier epoch left unlogged, `carry`): the newest MAX_GAPS
        self.gaps: set[int] = set()
        self.filling = False  # the peers are being asked for the gaps' reports
        self.gap_attempts = 0  # queries for the gaps so far in which some peer did not answer
        self._ask_at = 0.0  # the gaps are asked for again from then on
        self._lost: list[int] = []  # gaps given up (see the module docstring), until `take_lost`
        # epoch -> its allocation (to check kept reports of the gaps an earlier epoch left)
        self.known: Known = lambda e: alloc if e == alloc.epoch else known(e) if known is not None else None
        self.refusals = refusals if refusals is not None else Refusals()
        self.highest: dict[bytes, int] = {p: self.completed for p in alloc.peers}  # each peer's newest step
        self._behind = len(self.highest)  # peers whose newest step is < completed + STEP_WINDOW
        self._at_end = 0  # peers that reported the epoch's last step
        self._last = frozenset(pipe[-1] for pipe in alloc.pipelines)  # the peers whose loss counts
        # the epoch's predicted step: the allocation's, then re-estimated on the view as the peers
        # report compute measured in their own steps (a drift check that keeps the allocation)
        self.predicted_s = alloc.predicted_iteration_s

    @property
    def finished(self) -> bool:
        return self.completed + 1 >= self.alloc.end_step

    def add(self, peer: bytes, rep: StepReport) -> list[dict]:
        """Record a report; the lines of the steps it completes (see the module docstring). A
        step no report (or no last stage's report) of which arrived is passed over into `gaps`,
        to be filled from the reports the peers keep (`fill`). O(1) per report; O(peers) per
        completed step."""
        why = self._refusal(peer, rep)
        if why is not None:
            self.refusals.refuse(why, peer, f"epoch {rep.epoch} step {rep.step}, completed {self.completed}")
            return []
        old = self.highest[peer]
        if rep.step > old:
            self.highest[peer] = rep.step
            if old < self.completed + STEP_WINDOW <= rep.step:
                self._behind -= 1
            if rep.step == self.alloc.end_step - 1:
                self._at_end += 1
        if rep.step > self.completed + STEP_WINDOW:
            self.refusals.refuse(Refused.STEP_AHEAD, peer, f"step {rep.step}, completed {self.completed}")
        else:
            self.reports.setdefault(rep.step, {})[peer] = rep
        return self._advance()

    def _refusal(self, peer: bytes, rep: StepReport) -> Refused | None:
        if rep.epoch != self.alloc.epoch:
            return Refused.STEP_OTHER_EPOCH
        if peer not in self.highest:
            return Refused.STEP_NOT_PEER
        if rep.step <= self.completed:
            return Refused.STEP_OLD
        if rep.step >= self.alloc.end_step:
            return Refused.STEP_AHEAD
        if peer in self.reports.get(rep.step, {}):
            return Refused.STEP_REPEATED
        return None

    def _advance(self) -> list[dict]:
        """Complete the steps up to the newest kept step every peer reported (but not past a
        step no last stage's report of which came, fewer than REORDER_STEPS before it: reports
        may come out of order), up to the
        steps whose window every peer reported to its end (a report lost or later than that is
        not waited for), and to the epoch's last step once every peer reported it."""
        lines: list[dict] = []
        target = self.completed
        n = len(self.highest)
        while n:
            full = [s for s, got in self.reports.items() if len(got) == n]  # at most STEP_WINDOW steps
            if full:
                # a step with no report of a last stage waits for one (reports may come out of
                # order) until a step REORDER_STEPS later has every report
                top = max(full)
                waiting = [s for s in range(max(self.completed + 1, top - REORDER_STEPS + 1), top)
                           if s not in self.reports or self._last.isdisjoint(self.reports[s])]
                target = max(target, min(waiting) - 1 if waiting else top)
            if self._behind == 0:  # every peer reported the window's last step (or beyond)
                target = max(target, min(self.highest.values()) - STEP_WINDOW + 1)
            if self._at_end == n:  # the last step: no later report will come
                target = self.alloc.end_step - 1
            if target <= self.completed:
                return lines
            for step in range(max(self.completed + 1, target - MAX_GAPS + 1), target + 1):
                if step not in self.reports:
                    self.gaps.add(step)
            for step in sorted(s for s in self.reports if s <= target):
                got = self.reports.pop(step)
                if self._last.isdisjoint(got):  # no last stage's report: no loss yet, filled like a gap
                    self.gaps.add(step)
                    continue
                lines.append(self._line(step, got, self.alloc, partial=len(got) < n))
            self.completed = target
            self._bound_gaps()
            self._behind = sum(1 for h in self.highest.values() if h < target + STEP_WINDOW)
        return lines

    def backfill(self, reports: Iterable[tuple[bytes, StepReport]], steps: Iterable[int], known: Known, *,
                 need_loss: bool = False) -> list[dict]:
        """Lines for those of `steps` not logged yet, from the peers' own reports (peer, report),
        marked `backfilled`: each from the reports of its newest epoch (a step re-run after a
        rollback: its last run). A report counts only if its peer had a stage in its epoch and
        its step is one of that epoch's (`known` gives the epoch's allocation). Steps no report
        covers are left out; so are, with `need_loss`, steps no last stage's report covers."""
        wanted = set(steps) - self.logged
        by_step: dict[int, dict[int, dict[bytes, StepReport]]] = {}  # step -> epoch -> peer -> report
        allocs: dict[int, tuple[Allocation, frozenset[bytes]] | None] = {}  # epoch -> allocation, its peers
        for peer, r in reports:
            if r.step not in wanted:
                continue
            if r.epoch not in allocs:
                a = known(r.epoch)
                allocs[r.epoch] = (a, frozenset(a.peers)) if a is not None else None
            found = allocs[r.epoch]
            why = None
            if found is None:
                why = Refused.STEP_UNKNOWN_EPOCH
            elif peer not in found[1]:
                why = Refused.STEP_NOT_PEER
            elif not found[0].start_step <= r.step < found[0].end_step:
                why = Refused.STEP_OUT_OF_EPOCH
            if why is not None:
                self.refusals.refuse(why, peer, f"kept report of epoch {r.epoch} step {r.step}")
                continue
            by_step.setdefault(r.step, {}).setdefault(r.epoch, {}).setdefault(peer, r)
        lines = []
        for step in sorted(by_step):
            newest = max(by_step[step])
            found = allocs[newest]
            assert found is not None
            got = by_step[step][newest]
            if need_loss and {pipe[-1] for pipe in found[0].pipelines}.isdisjoint(got):
                continue
            lines.append(self._line(step, got, found[0], backfilled=True))
        return lines

    # ---- gaps: steps to fill from the reports the peers keep -----------------------------------

    def carry(self, steps: Iterable[int], *, asking: bool = False) -> None:
        """Steps before this epoch that an earlier epoch of the run left unlogged (its gaps, its
        steps its hand-out's back-fill did not cover): gaps of this log, asked for at once, or
        when the answers already asked for under this epoch come (`asking`: a failed hand-out's
        log of the same epoch was asking)."""
        self.gaps |= {s for s in steps if s < self.alloc.start_step} - self.logged
        self.filling = asking and bool(self.gaps)
        self._bound_gaps()

    def unlogged_before(self, step: int) -> set[int]:
        """The steps before `step` this log should have logged and has not: its gaps, and the
        steps after its last completed one (the newest MAX_GAPS of them)."""
        ahead = range(max(self.completed + 1, step - MAX_GAPS), min(step, self.alloc.end_step))
        return {s for s in self.gaps | set(ahead) if s < step} - self.logged

    def gap_query_due(self, now: float) -> bool:
        """Whether the peers are to be asked for the gaps' reports now (`asking` when they are)."""
        return bool(self.gaps) and not self.filling and now >= self._ask_at

    def asking(self) -> None:
        self.filling = True

    def gap_retry_at(self) -> float:
        """When the gaps are asked for again (inf: none waits)."""
        return self._ask_at if self.gaps and not self.filling else math.inf

    def take_lost(self) -> list[int]:
        """The gaps given up since the last call: steps no report of which can be found."""
        lost, self._lost = sorted(set(self._lost) - self.logged), []
        return lost

    def _bound_gaps(self) -> None:
        """Give up the gaps no peer can hold a report of any more (older than the reports a peer
        keeps), and all but the newest MAX_GAPS."""
        old = {s for s in self.gaps if s <= self.completed - MAX_REPORTS}
        if len(self.gaps) - len(old) > MAX_GAPS:
            old |= set(sorted(self.gaps - old)[:len(self.gaps) - len(old) - MAX_GAPS])
        if old:
            self.gaps -= old
            self._lost += sorted(old)

    def fill(self, answered: Mapping[bytes, Iterable[StepReport]], now: float, retry_s: float) -> list[dict]:
        """Lines for the gaps that the reports in these answers (peer -> the reports it keeps, one
        entry per peer that answered with its run state) cover. A gap no answer covers is given
        up once every peer of this epoch answered (`take_lost`); else it is asked for again: at
        once for the first GAP_ATTEMPTS queries, then after `retry_s`, doubling up to
        GAP_RETRY_MAX times. While a last stage's report of a gap may still come (some peer did
        not answer, attempts remain), a gap only first stages' reports cover waits for it."""
        self.filling = False
        everyone = set(self.alloc.peers) <= set(answered)
        self.gap_attempts += 1
        reports = [(p, r) for p, rs in answered.items() for r in rs]
        lines = self.backfill(reports, self.gaps, self.known,
                              need_loss=not everyone and self.gap_attempts < GAP_ATTEMPTS)
        self.gaps -= self.logged
        if everyone:
            self._lost += sorted(self.gaps)
            self.gaps.clear()
        if not self.gaps:
            self.gap_attempts, self._ask_at = 0, 0.0
        elif self.gap_attempts >= GAP_ATTEMPTS:
            self._ask_at = now + retry_s * min(GAP_RETRY_MAX, 1 << min(self.gap_attempts - GAP_ATTEMPTS, 30))
        return lines

    def _loss(self, step: int, reports: dict[bytes, StepReport], alloc: Allocation) -> tuple[float | None, dict]:
        """The step's loss from the last-stage peers' reports, and the disagreement ({} if none)."""
        last = [pipe[-1] for pipe in alloc.pipelines]
        for p, r in reports.items():
            if r.loss is not None and p not in last:
                self.refusals.refuse(Refused.LOSS_NOT_LAST_STAGE, p, f"step {step}")
        given = [(p, reports[p].loss) for p in last if p in reports and reports[p].loss is not None]
        if not given:
            return None, {}
        votes: dict[object, list[float]] = {}
        for _, loss in given:
            assert loss is not None
            votes.setdefault("nan" if math.isnan(loss) else loss, []).append(loss)
        most = max(votes.values(), key=len)
        if len(votes) == 1:
            return most[0], {}
        differ = {short_id(p): x for p, x in given}
        if 2 * len(most) <= len(given):  # no strict majority: no last stage decides alone
            logger.warning("step %d: the last stages disagree on the loss with no majority: %s; no loss logged",
                           step, ", ".join(f"{k} {v}" for k, v in differ.items()))
            return None, differ
        logger.warning("step %d: the last stages disagree on the loss: %s; logged %s", step,
                       ", ".join(f"{k} {v}" for k, v in differ.items()), most[0])
        return most[0], differ

    def _line(self, step: int, reports: dict[bytes, StepReport], alloc: Allocation, backfilled: bool = False,
              partial: bool = False) -> dict:
        loss, differ = self._loss(step, reports, alloc)

        def most(key: str) -> float | None:
            return max((getattr(r, key) for r in reports.values()), default=None)
        iteration_s = most("iteration_s")
        tokens = self.alloc.train.global_batch_seqs * self.alloc.model.seq_len
        line: dict = {"run": self.alloc.run_id.hex(), "step": step, "loss": loss, "epoch": alloc.epoch,
                      "term": self.alloc.term,
                      "iteration_s": iteration_s, "tokens_per_s": tokens / iteration_s if iteration_s else None,
                      "predicted_iteration_s": self.predicted_s,
                      "compute_s": most("compute_s"), "pipeline_s": most("pipeline_s"), "sync_s": most("sync_s")}
        sent = [sum(r.bytes_sent[i] for r in reports.values()) for i in range(len(BYTE_AXES))]
        if any(sent):  # payload bytes of the step's reports (of every peer, unless partial)
            line["bytes_sent"] = dict(zip(BYTE_AXES, sent))
        if partial:
            line["partial"] = True
        if backfilled:
            line["backfilled"] = True
        if differ:
            line["loss_disagreement"] = differ
            if loss is None:
                line["loss_no_majority"] = True
        self.logged.add(step)
        self.recent = (self.recent + [line])[-MAX_RECENT_STEPS:]
        return line
