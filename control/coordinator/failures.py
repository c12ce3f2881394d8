"""Failed-step reports at the coordinator, checked before they trigger anything (see
docs/control.md, "Who may send what").

A STEP with `failed` says a peer's runner ended on an error. It is taken only from a peer with a
stage in the current epoch, for that epoch, at most once per peer and epoch. It triggers a
reconfiguration only once the run states agree: a step that truly failed stops the steps of the
reporter's neighbours too (they wait for it, then fail), so the coordinator asks the epoch's
peers for their run states (its `Ask`, the "failed" probe) and triggers when a peer other than
the reporters no longer steps that epoch (or no answer came), or when every peer of the epoch
reported a failure. While every other peer steps, the report is ignored, logged and counted
(`failed-contradicted`); it stays pending and is checked again at the next checks, and is
dropped once the log completes a step more than `STEP_WINDOW` past where it stood when the
report came (the reporter stepped on). A peer may say it steps and not (built, its start lost):
a pending report whose epoch completed no step for `stall_s` (a few steps' time) since it came
triggers after all, as a peer that stalls the run would. The state is one entry per peer of the
epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from dtfm.net import short_id

from ..allocation import Allocation
from ..epoch.runstate import PeerRunState
from ..refusals import Refusals, Refused
from .steplog import STEP_WINDOW

__all__ = ["FailedSteps"]

logger = logging.getLogger(__name__)

MAX_REASON = 200


@dataclass
class _Report:
    reason: str
    completed: int | None  # the step log's last completed step when it came (None: not logged here)
    at: float  # when it came
    contradicted: bool = False


class FailedSteps:
    """The failed-step reports of the current epoch (see the module docstring)."""

    def __init__(self, refusals: Refusals):
        self.refusals = refusals
        self._epoch: tuple[bytes, int] | None = None  # (run, epoch) the reports are of
        self._heard: set[bytes] = set()  # peers that reported a failure in it
        self._pending: dict[bytes, _Report] = {}

    def _of(self, cur: Allocation) -> None:
        if self._epoch != (cur.run_id, cur.epoch):
            self._epoch = (cur.run_id, cur.epoch)
            self._heard.clear()
            self._pending.clear()

    def add(self, peer: bytes, cur: Allocation, run_id: object, epoch: object, reason: str,
            completed: int | None, now: float) -> Refused | None:
        """Take a report of the current epoch `cur` (`completed`: the step log's last completed
        step of it, None when this peer does not log it); a refusal is counted and returned."""
        why = None
        if run_id != cur.run_id:
            why = Refused.FAILED_OTHER_RUN
        elif epoch != cur.epoch:
            why = Refused.FAILED_OTHER_EPOCH  # a late report of an older epoch: already handled
        elif peer not in cur.peers:
            why = Refused.FAILED_NOT_PEER
        else:
            self._of(cur)
            if peer in self._heard:
                why = Refused.FAILED_REPEATED
        if why is not None:
            return self.refusals.refuse(why, peer, f"failed: {reason[:MAX_REASON]}")
        self._heard.add(peer)
        self._pending[peer] = _Report(reason[:MAX_REASON], completed, now)
        return None

    def due(self, cur: Allocation | None, completed: int | None) -> bool:
        """Whether reports of `cur` wait for a check of the run states; drops those the step log
        has moved past (`completed`: its last completed step of `cur`, None if not logged here)."""
        if cur is None or self._epoch != (cur.run_id, cur.epoch):
            self._pending.clear()
            return False
        if completed is not None:
            for peer, rep in list(self._pending.items()):
                if rep.completed is not None and completed > rep.completed + STEP_WINDOW:
                    logger.info("peer %s's failed step (%s) is past: epoch %d stepped on to step %d",
                                short_id(peer), rep.reason, cur.epoch, completed)
                    if not rep.contradicted:
                        self.refusals.refuse(Refused.FAILED_CONTRADICTED, peer, "the epoch stepped on")
                    del self._pending[peer]
        return bool(self._pending)

    def judge(self, cur: Allocation | None, states: Mapping[bytes, PeerRunState], completed: int | None,
              now: float, stall_s: float) -> list[str]:
        """The run states of the epoch's peers came back: the trigger reasons of the reports they
        confirm, or that no completed step contradicted for `stall_s` ([] when every other peer
        still steps the epoch: the reports stay pending)."""
        if cur is None or self._epoch != (cur.run_id, cur.epoch) or not self._pending:
            return []
        stopped = {p for p in cur.peers if p not in states or not _steps(states[p], cur)}
        stalled = [p for p, r in self._pending.items()
                   if (completed is None or completed == r.completed) and now - r.at >= stall_s]
        confirmed = bool(stopped - set(self._pending)) or set(cur.peers) <= set(self._pending)
        if confirmed or stalled:
            reasons = [f"peer {short_id(p)}: {r.reason}" + (f" (no step completed in {now - r.at:.3g} s since)"
                                                            if not confirmed and p in stalled else "")
                       for p, r in self._pending.items()]
            self._pending.clear()
            return reasons
        for peer, rep in self._pending.items():
            if not rep.contradicted:
                rep.contradicted = True
                logger.warning("peer %s says a step of epoch %d failed (%s) while every other peer of it is "
                               "stepping: ignored", short_id(peer), cur.epoch, rep.reason)
                self.refusals.refuse(Refused.FAILED_CONTRADICTED, peer, rep.reason)
        return []


def _steps(state: PeerRunState, cur: Allocation) -> bool:
    return state.running and (state.run_id, state.epoch) == (cur.run_id, cur.epoch)
