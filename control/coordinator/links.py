"""Links between live peers that failed a step: the coordinator's record of them
(`CutLinks`), which links an allocation uses, and the REACH probe's wire form (RUN_STATE
`op: reach`: "can you reach these peers?", answered with gossip pings). See docs/control.md,
"Gray failures".

A link that failed a step is left out of every allocation until it is measured healthy again:
the coordinator asks one end to ping the other every `link_retest_s`, and a ping that comes
back clears it. The planner gets the cut links and gives any allocation that uses one a cost no
other allocation has (control/coordinator/reshape.py); if every allocation of the reachable
peers uses one, the run pauses with the reason until a link heals.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dtfm.net import PEER_ID_BYTES, ProtocolError, get_float, short_id

__all__ = ["MAX_CUT_LINKS", "MAX_REACH_PEERS", "CutLinks", "ReachAnswer", "ReachRequest", "exchanges", "pair",
           "used_cut_links"]

MAX_REACH_PEERS = 4096
MAX_CUT_LINKS = 1024
MAX_REACH_TIMEOUT_S = 600.0

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


def _peer_list(obj: object, what: str) -> tuple[bytes, ...]:
    if not isinstance(obj, list) or len(obj) > MAX_REACH_PEERS:
        raise ProtocolError(f"{what} must be a list of at most {MAX_REACH_PEERS} peer ids")
    out = []
    for p in obj:
        if not isinstance(p, bytes) or len(p) != PEER_ID_BYTES:
            raise ProtocolError(f"{what}: a peer id must be {PEER_ID_BYTES} bytes")
        out.append(p)
    return tuple(out)


@dataclass(frozen=True)
class ReachRequest:
    """RUN_STATE `op: reach`: ping each of `peers`, each within `timeout_s`."""

    peers: tuple[bytes, ...]
    timeout_s: float

    def to_wire(self) -> dict:
        return {"op": "reach", "peers": list(self.peers), "timeout_s": self.timeout_s}

    @classmethod
    def from_wire(cls, d: dict) -> ReachRequest:
        peers = _peer_list(d.get("peers"), "reach peers")
        timeout = get_float(d, "timeout_s", 0.0, MAX_REACH_TIMEOUT_S)
        if timeout <= 0:
            raise ProtocolError("reach timeout_s must be positive")
        return cls(peers, timeout)


@dataclass(frozen=True)
class ReachAnswer:
    """Which of the asked peers answered a ping in time, and which did not."""

    reached: tuple[bytes, ...]
    unreached: tuple[bytes, ...]

    def to_wire(self) -> dict:
        return {"reached": list(self.reached), "unreached": list(self.unreached)}

    @classmethod
    def from_wire(cls, obj: object) -> ReachAnswer:
        if not isinstance(obj, dict):
            raise ProtocolError("reach answer must be a map")
        return cls(_peer_list(obj.get("reached"), "reached"), _peer_list(obj.get("unreached"), "unreached"))
