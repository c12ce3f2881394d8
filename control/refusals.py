"""Refused control-plane input, counted per reason (see docs/control.md, "Who may send what").

Each machine that refuses what a peer sent owns one `Refusals`: the coordinator (STEP), the
epoch machine (RUN_STATE) and the recovery server (FETCH_MANIFEST, FETCH_CHUNK). A refusal is
logged at DEBUG with the peer and counted under its reason; `status` shows the sums
(`refusals`). The reasons are a closed enum, so the counters are bounded whatever peers send.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping

from dtfm.net import short_id

__all__ = ["Refusals", "Refused", "merge_counts"]

logger = logging.getLogger(__name__)


class Refused(enum.Enum):
    """Why a message (or part of one) was refused: the code status shows, and the text an
    answer carries. Append only: the codes are read by tools."""

    # STEP reports, at the coordinator (control/coordinator/steplog.py)
    STEP_OTHER_RUN = ("step-other-run", "a step report of a run this coordinator does not log")
    STEP_OTHER_EPOCH = ("step-other-epoch", "a step report of another epoch than the one logged")
    STEP_NOT_PEER = ("step-not-peer", "a step report from a peer with no stage in that epoch")
    STEP_OLD = ("step-old", "a step report of a step already completed")
    STEP_REPEATED = ("step-repeated", "a second report of one step from one peer")
    STEP_AHEAD = ("step-ahead", "a step report beyond the window after the last completed step")
    STEP_OUT_OF_EPOCH = ("step-out-of-epoch", "a kept step report outside its epoch's steps")
    STEP_UNKNOWN_EPOCH = ("step-unknown-epoch", "a kept step report of an epoch this peer does not know")
    LOSS_NOT_LAST_STAGE = ("loss-not-last-stage", "a loss from a peer that is no last stage")
    # STEP failed, at the coordinator (control/coordinator/failures.py)
    FAILED_OTHER_RUN = ("failed-other-run", "a failed step of another run")
    FAILED_OTHER_EPOCH = ("failed-other-epoch", "a failed step of another epoch than the current one")
    FAILED_NOT_PEER = ("failed-not-peer", "a failed step from a peer with no stage in the epoch")
    FAILED_REPEATED = ("failed-repeated", "a second failed step from one peer in one epoch")
    FAILED_CONTRADICTED = ("failed-contradicted", "a failed step while every other peer of the epoch steps")
    # RUN_STATE, at every peer (control/epoch/access.py)
    RUN_STATE_OUTSIDER = ("run-state-outsider", "only the coordinator and the peers of the run read its state")
    OFFER_NOT_COORDINATOR = ("offer-not-coordinator", "only the coordinator asks for offers")
    # FETCH_MANIFEST / FETCH_CHUNK, at a holder (control/epoch/access.py)
    FETCH_NOT_NAMED = ("fetch-not-named", "only the peers an allocation names fetch its stages")
    # RUN_STATE export, at a holder (control/export.py, control/epoch/access.py)
    EXPORT_NOT_SIGNED = ("export-not-signed", "only the peer an operator's signed export names gathers a run")
    # ALLOCATION, at every peer (control/epoch/machine.py, control/election/state.py)
    BAD_COUNCIL = ("bad-council", "an allocation whose council does not follow from this peer's")

    def __init__(self, code: str, text: str):
        self.code = code
        self.text = text


class Refusals:
    """Counts of refused input per reason, of one owner."""

    def __init__(self) -> None:
        self._counts: dict[Refused, int] = {}

    def refuse(self, why: Refused, peer: bytes, detail: str = "") -> Refused:
        """Count and log one refusal (DEBUG, naming the peer); returns `why`."""
        self._counts[why] = self._counts.get(why, 0) + 1
        logger.debug("refused %s from %s: %s%s", why.code, short_id(peer), why.text, f" ({detail})" if detail else "")
        return why

    def count(self, why: Refused) -> int:
        return self._counts.get(why, 0)

    def counts(self) -> dict[str, int]:
        """code -> count, for status."""
        return {why.code: n for why, n in self._counts.items()}


def merge_counts(parts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """The sum of several owners' `counts()`, sorted by code."""
    out: dict[str, int] = {}
    for part in parts:
        for code, n in part.items():
            out[code] = out.get(code, 0) + n
    return dict(sorted(out.items()))
