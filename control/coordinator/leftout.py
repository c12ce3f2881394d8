"""Peers the coordinator leaves out of its allocations because they refused one (docs/control.md,
"Refusing peers"; docs/security.md, N2).

A peer that refuses an allocation the others accept (or does not answer it in time) is unusable
now, whatever it says: its data set differs, it cannot build its stage, it follows another
coordinator, or it lies. Obeying it would stop the run for everyone, so the next attempts are
placed without it, for a back-off that doubles with each refusal in a row (`backoff_s` up to
`max_backoff_s`), and its refusal does not count toward stopping the run. Once its back-off ends
it is placed again (an honest peer whose trouble passed is back); an allocation it accepts
clears its record. A membership refusal (its gossip does not agree with the coordinator's yet)
is retried once without leaving it out: gossip converges, a liar does not. A new incarnation
(gossip tells that the peer restarted) ends the back-off of a peer that refused once; a peer
that refused again waits its whole back-off, so a liar that restarts or bumps its incarnation
at will cannot force a reconfiguration at each check.

`LeftOut` is pure: the coordinator tells it each refusal and acceptance with its `now`, and
asks it which peers are out now.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..events import LeftOutPeer

__all__ = ["MAX_LEFT_OUT", "NO_ANSWER", "LeftOut"]

MAX_LEFT_OUT = 1024  # peers remembered (the oldest records go first: a left-out peer is seldom one of them)
NO_ANSWER = "no-answer"  # the code of a peer that did not answer the allocation in time


@dataclass
class _Record:
    code: str
    reason: str
    since: float
    until: float
    refusals: int
    incarnation: int | None  # the peer's incarnation when it refused, as gossip told
    out: bool  # left out (a first membership refusal is only remembered)


class LeftOut:
    """The refusing peers and their back-offs (see the module docstring)."""

    def __init__(self, backoff_s: float, max_backoff_s: float, *, membership_codes: Iterable[str] = ()):
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {backoff_s!r}, {max_backoff_s!r}")
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.membership_codes = frozenset(membership_codes)
        self._records: dict[bytes, _Record] = {}

    def refused(self, peer: bytes, code: str | None, reason: str, now: float, incarnation: int | None) -> bool:
        """Record `peer`'s refusal (`code` None: it did not answer); whether it is left out now."""
        code = code or NO_ANSWER
        prev = self._records.get(peer)
        count = (prev.refusals if prev is not None else 0) + 1
        # a membership refusal right after anything but another one: retried as it is
        out = not (code in self.membership_codes and (prev is None or prev.code not in self.membership_codes))
        backoff = min(self.max_backoff_s, self.backoff_s * 2 ** min(count - 1, 32)) if out else 0.0
        self._bound(peer)
        self._records[peer] = _Record(code, reason[:1000], now, now + backoff, count, incarnation, out)
        return out

    def accepted(self, peers: Iterable[bytes]) -> None:
        """`peers` accepted an allocation: their records are cleared."""
        for p in peers:
            self._records.pop(p, None)

    def clear(self) -> None:
        """Every peer is placed again (an operator's resume: the operator may have fixed them)."""
        self._records.clear()

    def out(self, now: float, incarnations: Mapping[bytes, int] | None = None) -> frozenset[bytes]:
        """The peers left out at `now`. `incarnations`: gossip's current incarnation of each peer;
        a peer that refused once and restarted since (a higher one) is placed again at once."""
        incarnations = incarnations or {}
        self._forget(now)
        for p, rec in self._records.items():
            inc = incarnations.get(p)
            if (rec.out and rec.refusals == 1 and rec.until > now and inc is not None
                    and rec.incarnation is not None and inc > rec.incarnation):
                rec.until = now
        return frozenset(p for p, rec in self._records.items() if rec.out and rec.until > now)

    def snapshot(self, now: float, wall_offset: float = 0.0) -> tuple[LeftOutPeer, ...]:
        """The peers left out at `now`, their times in wall time, for `status` and events."""
        return tuple(LeftOutPeer(p, r.code, r.reason, r.since + wall_offset, r.until + wall_offset, r.refusals)
                     for p, r in sorted(self._records.items()) if r.out and r.until > now)

    def why(self, peers: Iterable[bytes], now: float, *, timed: bool = True) -> str:
        """Who of `peers` is left out and why, in words (for a stop's reason and the logs);
        `timed`: with how long each stays out."""
        return "; ".join(LeftOutPeer(p, r.code, r.reason, r.since, r.until, r.refusals).describe(now if timed else None)
                         for p, r in sorted(self._records.items()) if p in set(peers) and r.out and r.until > now)

    def _forget(self, now: float) -> None:
        """Records whose back-off ended more than `max_backoff_s` ago: a refusal after that is a first one."""
        for p in [p for p, r in self._records.items() if r.until + self.max_backoff_s < now]:
            del self._records[p]

    def _bound(self, peer: bytes) -> None:
        if peer in self._records:
            return
        while len(self._records) >= MAX_LEFT_OUT:
            self._records.pop(min(self._records, key=lambda p: self._records[p].until))
