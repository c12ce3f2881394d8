"""What the coordinator makes of its peers' typed answers (control/answers.py): a peer that gave
none, or gave one of another kind, reads as a refusal, no start, no stop or no offer, never as
an error of the machine."""

from __future__ import annotations

from collections.abc import Mapping

from ..answers import AllocationAnswer, KeepAnswer, NoAnswer, OfferAnswer, PeerAnswer, StartAnswer, StopAnswer
from ..epoch.runstate import PeerRunState
from ..reach import ReachAnswer

__all__ = ["allocation_answer", "kept", "offer_answer", "reached", "run_states", "started", "stopped", "why"]


def why(a: PeerAnswer) -> str | None:
    """The reason a peer gave (or the shell's, for no answer), if any."""
    return None if isinstance(a, (PeerRunState, ReachAnswer)) else a.reason


def run_states(answers: Mapping[bytes, PeerAnswer]) -> dict[bytes, PeerRunState]:
    """The run states among `answers` (RUN_STATE `query`); any other answer is left out."""
    return {p: a for p, a in answers.items() if isinstance(a, PeerRunState)}


def allocation_answer(a: PeerAnswer) -> AllocationAnswer:
    """An answer to an ALLOCATION; no answer is a refusal without a code."""
    if isinstance(a, AllocationAnswer):
        return a
    return AllocationAnswer(False, None, a.reason if isinstance(a, NoAnswer) else None)


def offer_answer(a: PeerAnswer) -> OfferAnswer:
    """An answer to a RUN_STATE offer; no answer offers nothing."""
    return a if isinstance(a, OfferAnswer) else OfferAnswer(None, 0, why(a))


def started(a: PeerAnswer) -> bool:
    return isinstance(a, StartAnswer) and a.started


def stopped(a: PeerAnswer) -> bool:
    return isinstance(a, StopAnswer) and a.stopped


def kept(a: PeerAnswer) -> bool:
    return isinstance(a, KeepAnswer) and a.kept


def reached(a: PeerAnswer) -> tuple[bytes, ...]:
    """The peers a reach answer says it reached; none for any other answer."""
    return a.reached if isinstance(a, ReachAnswer) else ()
