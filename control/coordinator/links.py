"""Links between live peers that failed a step: the coordinator's record of them
(`CutLinks`) and which links an allocation uses (the REACH probe that finds and retests them:
control/reach.py). See docs/control.md, "Gray failures".

A link that failed a step is left out of every allocation until it is measured healthy again:
the coordinator asks one end to ping the other every `link_retest_s`, and a ping that comes
back clears it. The planner gets the cut links and gives any allocation that uses one a cost no
other allocation has (control/coordinator/reshape.py); if every allocation of the reachable
peers uses one, the run pauses with the reason until a link heals.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dtfm.net import short_id

__all__ = ["MAX_CUT_LINKS", "CutLinks", "exchanges", "pair", "used_cut_links"]

MAX_CUT_LINKS = 1024

Link = tuple[bytes, bytes]


def pair(a: bytes, b: bytes) -> Link:
    """A link as an ordered pair (links are cut in both directions or neither, for planning)."""
    return (a, b) if a < b else (b, a)


def exchanges(pipelines: Sequence[Sequence[bytes]]) -> set[Link]:
    """The links a layout's peers exchange tensors over in a step: the rule of
    `Allocation.neighbours` (every pair of a pipeline; in a DP group the ring's neighbours, and
    every pair on the last stage)."""
    out: set[Link] = set()
    dp = len(pipelines)
    if dp == 0:
        return out
    stages = len(pipelines[0])
    for pipe in pipelines:
        for i in range(stages):
            for j in range(i + 1, stages):
                out.add(pair(pipe[i], pipe[j]))
    for s in range(stages):
        group = [p[s] for p in pipelines]
        if s == stages - 1:
            out.update(pair(a, b) for i, a in enumerate(group) for b in group[i + 1:])
        else:
            out.update(pair(group[d], group[(d + 1) % dp]) for d in range(dp) if dp > 1)
    return out


def used_cut_links(pipelines: Sequence[Sequence[bytes]], cut: Iterable[Link]) -> list[Link]:
    """The cut links a layout would exchange tensors over."""
    return sorted(exchanges(pipelines) & {pair(a, b) for a, b in cut})


class CutLinks:
    """Links that failed a step, with why, until measured healthy again."""

    def __init__(self) -> None:
        self._why: dict[Link, str] = {}

    def __bool__(self) -> bool:
        return bool(self._why)

    def __contains__(self, link: Link) -> bool:
        return pair(*link) in self._why

    def add(self, link: Link, why: str) -> None:
        if len(self._why) < MAX_CUT_LINKS:
            self._why[pair(*link)] = why

    def clear(self, link: Link) -> None:
        self._why.pop(pair(*link), None)

    def forget_peers(self, keep: Iterable[bytes]) -> None:
        """Drop the links of peers no longer in `keep` (a peer that left has no links to test)."""
        alive = set(keep)
        for link in [k for k in self._why if not set(k) <= alive]:
            del self._why[link]

    def pairs(self) -> frozenset[Link]:
        return frozenset(self._why)

    def why(self, link: Link) -> str:
        return self._why.get(pair(*link), "")

    def describe(self) -> str:
        return ", ".join(f"{short_id(a)}-{short_id(b)}" for a, b in sorted(self._why))
