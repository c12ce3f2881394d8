"""Gossip's part of `dtfm-peer status`, bounded whatever the member table holds.

The status crosses the control socket in one frame (4 MiB by default), and a member table can
hold `max_members` (4,096) entries, most of them fakes in a flood. So the report carries:

    counts:     members by status state (alive, suspect, unconfirmed, dead, left) and total
    members:    the first MAX_MEMBERS_LISTED members, alive first (then suspect, unconfirmed,
                dead, left; by peer id within a state)
    latency:    this peer's own measurements, the first MAX_LATENCY_LISTED by target, each
                with what the other end measured of the same link (its signed report), how
                long ago this peer measured it, and the link's state (`link_state`)
    view:       the N x N view over the live members, matrices included only for
                N <= MAX_VIEW_PEERS, disputed links the first MAX_DISPUTED_LISTED; always
                `peers` (N), `measured_links`, `expected_links`, `complete`
    truncated:  the names of the lists cut short (empty: nothing left out)
    refused:    membership updates refused, by reason (a fixed set of reasons: the rate of
                new members, the caps per address group, a full table, bad signatures, ...)
    evicted:    members taken out to make room in a full table

A link is `agreed` when both ends measured it and their figures are within
`DISAGREEMENT_RATIO` of each other, `disputed` when they are further apart (the round trips or
the bandwidths: `disputed_on` says which), `one-sided` when the other end has not reported it
(yet). The view (gossip/view.py) takes the worse of the two figures either way, so a disputed
link only ever looks slower than one end measured it; the flag says the two ends' measurements
disagree, which on loopback or a LAN (sub-millisecond round trips, CPU-bound transfers) is
ordinary noise, and between distant machines points at an asymmetric path or a peer whose
figures are off.

An unconfirmed member (not dead or left, never answered a ping at the address it claims)
shows the state `unconfirmed`: it does not count as alive anywhere.

Worst-case size, from the field limits of a claim (a host of 255 and a region of 64
characters, up to 4 bytes each in UTF-8): a member row packs to at most ~1.5 KiB, so 256 rows
take ~0.4 MiB; a latency row ~70 bytes; the view at 256 peers two 256 x 256 float matrices,
~1.2 MiB. The whole gossip part stays under 2 MiB (tests/gossip/test_gossip_flood.py checks the worst
case); the daemon fits the whole report into its reply frame (`dtfm.peer.status.fit_report`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from .members import Member
from .records import Entry, Report
from .view import DISAGREEMENT_RATIO, NetworkView

__all__ = ["gossip_status", "link_state", "status_state", "LINK_STATES", "MAX_MEMBERS_LISTED",
           "MAX_LATENCY_LISTED", "MAX_VIEW_PEERS", "MAX_DISPUTED_LISTED", "STATUS_STATES"]

MAX_MEMBERS_LISTED = 256
MAX_LATENCY_LISTED = 256
MAX_VIEW_PEERS = 256  # dtfm-swarm runs at most 256 peers: its whole view is listed
MAX_DISPUTED_LISTED = 64

STATUS_STATES = ("alive", "suspect", "unconfirmed", "dead", "left")  # the order members are listed in
_RANK = {name: k for k, name in enumerate(STATUS_STATES)}
LINK_STATES = ("agreed", "disputed", "one-sided")  # a measured link's state (module docstring)


def status_state(m: Member, confirmed: bool) -> str:
    """A member's state as status shows it: `unconfirmed` for a member neither gone nor
    confirmed, else its state's name."""
    if not confirmed and not m.state.gone:
        return "unconfirmed"
    return m.state.name.lower()


def _member_row(m: Member, state: str) -> dict:
    return {"id": m.peer_id.hex(), "short_id": m.short_id, "region": m.region,
            "address": f"{m.host}:{m.port}", "state": state, "incarnation": m.incarnation}


def _apart(a: float, b: float, tolerance: float) -> bool:
    """Both figures known (finite, positive) and more than `tolerance` (a ratio) apart."""
    if not (np.isfinite(a) and np.isfinite(b) and a > 0 and b > 0):
        return False
    return max(a, b) / min(a, b) > tolerance


def link_state(mine: Entry, theirs: Entry | None,
               tolerance: float = DISAGREEMENT_RATIO) -> tuple[str, list[str]]:
    """(state, disputed_on) of the link this peer measured as `mine` and the other end as
    `theirs` (None: not reported): `one-sided`, `disputed` (on "rtt" and/or "bandwidth": the
    two figures are more than `tolerance` apart, as gossip/view.py flags them) or `agreed`."""
    if theirs is None:
        return "one-sided", []
    on = [name for name, a, b in (("rtt", mine.rtt_ms, theirs.rtt_ms),
                                  ("bandwidth", mine.bandwidth_gbps, theirs.bandwidth_gbps))
          if _apart(a, b, tolerance)]
    return ("disputed" if on else "agreed"), on


def _latency_row(e: Entry, theirs: Entry | None, measured_s_ago: float | None) -> dict:
    state, on = link_state(e, theirs)
    return {"target": e.target[:4].hex(), "rtt_ms": e.rtt_ms,
            "bandwidth_gbps": e.bandwidth_gbps or None, "samples": e.samples,
            "peer_rtt_ms": theirs.rtt_ms if theirs is not None else None,
            "peer_bandwidth_gbps": (theirs.bandwidth_gbps or None) if theirs is not None else None,
            "measured_s_ago": measured_s_ago, "link": state, "disputed_on": on}


def _their_entry(me: bytes | None, other: bytes, reports: Mapping[bytes, Report]) -> Entry | None:
    """`other`'s entry for `me`, from the report signed under its own name (None: none)."""
    r = reports.get(other)
    if me is None or r is None or r.measurer != other:
        return None
    return next((e for e in r.entries if e.target == me), None)


def _estimable(r: Report | None) -> bool:
    """Whether a report holds what the view estimates a peer's links from."""
    return r is not None and bool(r.coord) and r.up_gbps > 0 and r.down_gbps > 0


def links_known(peers: Sequence[bytes], reports: Mapping[bytes, Report]) -> int:
    """Ordered pairs of distinct `peers` with a delay and a bandwidth known from either end
    (what `NetworkView.pairs_known` counts), without building the N x N matrices."""
    live = set(peers)
    rtt: set[tuple[bytes, bytes]] = set()
    bw: set[tuple[bytes, bytes]] = set()
    for key, r in reports.items():
        if key != r.measurer or r.measurer not in live:
            continue
        for e in r.entries:
            if e.target not in live or e.target == r.measurer:
                continue
            pair = (min(r.measurer, e.target), max(r.measurer, e.target))
            if np.isfinite(e.rtt_ms) and e.rtt_ms > 0:
                rtt.add(pair)
            if np.isfinite(e.bandwidth_gbps) and e.bandwidth_gbps > 0:
                bw.add(pair)
    return 2 * len(rtt & bw)


def gossip_status(members: Iterable[Member], is_confirmed: Callable[[bytes], bool],
                  latency: Iterable[Entry], live: Sequence[bytes], reports: Mapping[bytes, Report],
                  view: Callable[[], NetworkView], *, max_members: int = MAX_MEMBERS_LISTED,
                  max_latency: int = MAX_LATENCY_LISTED, max_view_peers: int = MAX_VIEW_PEERS,
                  max_disputed: int = MAX_DISPUTED_LISTED, me: bytes | None = None,
                  measured_s_ago: Mapping[bytes, float] | None = None,
                  refused: Mapping[str, int] | None = None, evicted: int = 0) -> dict:
    """The gossip status report (module docstring). `live`: the members that count as alive,
    the view's peers; `view()` is called only when it is listed (len(live) <= max_view_peers);
    `me`: this peer (to find the other ends' figures of its links in `reports`);
    `measured_s_ago`: per target, how long ago this peer last measured the link; `refused`,
    `evicted`: the membership's counters."""
    truncated: list[str] = []
    counts = dict.fromkeys(STATUS_STATES, 0)
    rows: list[tuple[int, bytes, Member, str]] = []
    for m in members:
        state = status_state(m, is_confirmed(m.peer_id))
        counts[state] += 1
        rows.append((_RANK[state], m.peer_id, m, state))
    total = len(rows)
    if total > max_members:
        truncated.append("members")
    rows.sort(key=lambda r: (r[0], r[1]))
    entries = sorted(latency, key=lambda e: e.target)
    ages = dict(measured_s_ago or {})
    if len(entries) > max_latency:
        truncated.append("latency")
    n = len(live)
    if n <= max_view_peers:
        v = view()
        as_dict = v.as_dict()
        if len(as_dict["disputed"]) > max_disputed:
            truncated.append("view.disputed")
            as_dict["disputed"] = as_dict["disputed"][:max_disputed]
        view_part = {**as_dict, "measured_links": v.pairs_measured(),
                     "estimated_links": v.pairs_known() - v.pairs_measured()}
    else:
        truncated.append("view")
        view_part = {"measured_links": links_known(live, reports)}
    view_part.update({"peer_count": n, "expected_links": n * (n - 1)})
    if "complete" not in view_part:  # without the matrices: measured, or every peer's claims there to estimate
        view_part["complete"] = (view_part["measured_links"] == n * (n - 1)
                                 or all(_estimable(reports.get(p)) for p in live))
    return {"counts": {**counts, "total": total},
            "members": [_member_row(m, state) for _, _, m, state in rows[:max_members]],
            "latency": [_latency_row(e, _their_entry(me, e.target, reports), ages.get(e.target))
                        for e in entries[:max_latency]],
            "view": view_part, "truncated": truncated,
            "refused": dict(sorted((refused or {}).items())), "evicted": evicted}
