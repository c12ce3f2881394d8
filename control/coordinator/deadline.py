"""The step deadline: when the coordinator's epoch is overdue, whom it probes, and what the
probe's answers mean (see docs/control.md, "Gray failures"). Pure: the coordinator machine
calls it with its own clock.

A peer that stops answering but keeps its sockets open (a frozen process, a stalled machine)
and a link that drops everything between two live peers look alike from the coordinator: the
next step never completes. `StepWatch` learns the epoch's step times and says when the next
step is overdue: `median + mads x MAD` of the recent intervals between completed steps, never
under `floor_s` (the epoch's first steps, before there are enough intervals, get `first_s`).
The coordinator then probes the *laggards*, the peers of the epoch whose report of the overdue
step is missing, and their neighbours in the plan (a peer that froze right after its report
holds the others up: they wait for its acknowledgements): each is asked to reach the others (a
gossip ping). `judge` reads the answers: a peer asked that does not answer is out; one that
answers but cannot reach a neighbour that answered too names a cut link; when every peer asked
answers and reaches its neighbours, the step is only slow: suspicion is cleared and the
deadline backs off (doubling per answered probe until the next step completes).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dtfm.net import short_id

from ..answers import NoAnswer, PeerAnswer
from ..reach import ReachAnswer
from .links import pair

__all__ = ["DeadlineRules", "StepWatch", "Verdict", "judge", "laggards", "missed_deadline", "probe_targets"]

MAX_BACKOFF_DOUBLINGS = 4  # an answered probe at most doubles the deadline this often (x16)


@dataclass(frozen=True)
class DeadlineRules:
    """How the coordinator decides that a step is overdue (the plane's `step_deadline_*`)."""

    floor_s: float  # the deadline is never shorter
    mads: float  # deadline = median + mads x MAD of the recent intervals
    first_s: float  # the deadline of an epoch's first step, and while fewer than `min_samples` intervals are known
    window: int = 32  # intervals kept
    min_samples: int = 3

    def __post_init__(self) -> None:
        if not (0 < self.floor_s and 0 <= self.mads and 0 < self.first_s):
            raise ValueError("floor_s and first_s must be positive, mads non-negative")
        if not (1 <= self.min_samples <= self.window):
            raise ValueError("need 1 <= min_samples <= window")

    def deadline_s(self, intervals: Sequence[float]) -> float:
        """The deadline of the next step after these intervals between completed steps."""
        if len(intervals) < self.min_samples:
            return max(self.floor_s, self.first_s)
        med = statistics.median(intervals)
        mad = statistics.median(abs(x - med) for x in intervals)
        return max(self.floor_s, med + self.mads * mad)


class StepWatch:
    """One epoch's completed steps as the coordinator saw them, and when the next is due.
    `prior`: the previous epoch's intervals, scaled to this epoch's predicted step time, which
    the epoch's own intervals replace as they come."""

    def __init__(self, rules: DeadlineRules, epoch: int, started: float, prior: Iterable[float] = ()):
        self.rules = rules
        self.epoch = epoch
        self.last_at = started  # the epoch's start, then its last completed step
        self.steps = 0  # steps completed in this epoch
        self.intervals: deque[float] = deque(prior, maxlen=rules.window)
        self.answered = 0  # probes answered since the last completed step
        self.extended_to: float | None = None  # after an answered probe: due then

    def completed(self, now: float) -> None:
        """A step of the epoch completed at `now` (the first one's interval, which includes
        warming up, is not a sample)."""
        if self.steps > 0:
            self.intervals.append(max(0.0, now - self.last_at))
        self.steps += 1
        self.last_at = now
        self.answered, self.extended_to = 0, None

    def deadline_s(self) -> float:
        return self.rules.deadline_s(list(self.intervals))

    def due_at(self) -> float:
        """When the next step is overdue (the epoch's first step, which warms up, gets at least
        `first_s`)."""
        if self.extended_to is not None:
            return self.extended_to
        if self.steps == 0:
            return self.last_at + max(self.rules.first_s, self.deadline_s())
        return self.last_at + self.deadline_s()

    def prior_for(self, scale: float) -> list[float]:
        """This epoch's intervals for the next epoch, times `scale` (the ratio of the epochs'
        predicted step times)."""
        return [x * scale for x in self.intervals] if 0 < scale < 1e6 else []

    def probe_answered(self, now: float) -> None:
        """Every laggard answered and reached its neighbours: the step is slow, not stuck. The
        next look is a deadline later, doubled per answered probe."""
        self.answered += 1
        self.extended_to = now + self.deadline_s() * 2 ** min(self.answered, MAX_BACKOFF_DOUBLINGS)


def laggards(peers: Iterable[bytes], reported: Iterable[bytes]) -> list[bytes]:
    """The peers of the epoch whose report of the overdue step is missing."""
    got = set(reported)
    return sorted(p for p in set(peers) if p not in got)


def probe_targets(lagging: Sequence[bytes], neighbours: Mapping[bytes, Iterable[bytes]]) -> list[bytes]:
    """Whom the laggards are asked to reach: their neighbours in the plan."""
    return sorted({q for p in lagging for q in neighbours.get(p, ())})


@dataclass(frozen=True)
class Verdict:
    """What a deadline probe found."""

    silent: tuple[bytes, ...]  # laggards that did not answer: out
    cut: tuple[tuple[bytes, bytes], ...]  # (a, b), a < b: both answered, one could not reach the other
    slow: bool  # every laggard answered and reached its neighbours

    @property
    def stuck(self) -> bool:
        return bool(self.silent or self.cut)


def judge(lagging: Sequence[bytes], neighbours: Mapping[bytes, Iterable[bytes]],
          answers: Mapping[bytes, PeerAnswer]) -> Verdict:
    """The verdict on a deadline probe of `lagging` (see the module docstring). `answers` are
    the typed answers per asked peer (control/answers.py); a malformed one counts as answered,
    with nothing learnt from it, and a peer without one (`NoAnswer`) as silent."""
    heard: dict[bytes, ReachAnswer | None] = {}
    for p in lagging:
        answer = answers[p] if p in answers else NoAnswer("not asked")
        if isinstance(answer, NoAnswer):
            continue  # no answer within the probe's time
        heard[p] = answer if isinstance(answer, ReachAnswer) else None
    silent = tuple(p for p in lagging if p not in heard)
    cut = set()
    for p, reach in heard.items():
        if reach is None:
            continue
        for q in reach.unreached:
            if q in heard and q in set(neighbours.get(p, ())):
                cut.add(pair(p, q))
    return Verdict(silent, tuple(sorted(cut)), not silent and not cut)


def missed_deadline(peer: bytes, step: int, deadline_s: float, probe_s: float) -> str:
    """The trigger of a reconfiguration around a silent laggard."""
    return (f"peer {short_id(peer)} missed the step deadline (step {step}, {deadline_s:.1f} s) and did not "
            f"answer a probe within {probe_s:g} s")
