"""What the parts of the coordinator machine read and never change: the peer's identity, the
election, the peer's epoch machine (told only by the events the coordinator feeds it), the
gossiped swarm, the scheduler, the timings and the wall clock; and how they ask peers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from dtfm.gossip import NetworkView
from dtfm.train import GPTSpec, TrainConfig

from ..actions import Ask
from ..allocation import Allocation
from ..compute import GAUGE_SKIP_STEPS, GAUGE_STEPS
from ..epoch.machine import ElectionView, EpochMachine
from ..messages import ControlMsg
from .deadline import DeadlineRules
from .keys import RequestKey
from .request import TrainRequest
from .reshape import ReshapePlan
from .schedule import Placement

__all__ = ["CoordinatorTimings", "Planner", "Reads", "Swarm", "WallClock", "ask", "named"]


class Swarm(Protocol):
    """What the coordinator reads of the gossiped swarm."""

    def live_peers(self) -> Iterable[bytes]: ...
    def known_peers(self) -> Iterable[bytes]: ...
    def regions(self) -> dict[bytes, str]: ...
    def view(self) -> NetworkView: ...
    def measured_view(self, candidates: Iterable[bytes]) -> tuple[NetworkView, list[bytes]]: ...
    def incarnations(self) -> Mapping[bytes, int]: ...


class Planner(Protocol):
    """The scheduler, as the coordinator calls it (off the event loop: see `Compute`)."""

    def reshape(self, view: NetworkView, cur: Allocation, *, live: frozenset[bytes], remaining_steps: int,
                regions: dict[bytes, str], seed: int, force: bool,
                cut: frozenset[tuple[bytes, bytes]] = frozenset()) -> ReshapePlan: ...

    def first_placement(self, view: NetworkView, req: TrainRequest, model: GPTSpec, train: TrainConfig,
                        regions: dict[bytes, str]) -> Placement: ...


@dataclass(frozen=True)
class CoordinatorTimings:
    accept_timeout_s: float
    request_timeout_s: float
    stop_timeout_s: float
    check_interval_s: float
    drift_check_s: float
    report_gather_s: float
    probe_timeout_s: float
    paused_retry_s: float
    stop_poll_s: float
    max_reconfig_attempts: int
    deadline: DeadlineRules | None = None  # the step deadline (None: steps are not watched)
    deadline_probe_timeout_s: float = 4.0  # a laggard answers a deadline probe within this
    link_retest_s: float = 2.0  # a cut link is pinged again this often
    # An operator's signed operation is taken this long before or after its time (clock skew;
    # a start also for its --min-peers wait after it): an older one is not taken again.
    operator_skew_s: float = 300.0
    # A peer that announced a planned leave is kept out of allocations this long (it leaves
    # gossip at once once handed off; a peer that comes back later is placed again).
    leaving_kept_s: float = 120.0
    # The council the coordinator aims for (3, 5 or 7 voters; control/election/council.py): more
    # voters survive more crashes (5: one, 7: two) at the cost of more votes per election.
    council_size: int = 5
    # A rollback that would run more completed steps again than a checkpoint interval waits for
    # a peer holding a newer state to come back (a restarted peer brings its data dir's
    # checkpoints) at most as long as running those steps again is predicted to take, and at
    # most this long; 0: never waits.
    rollback_wait_max_s: float = 120.0
    # A peer that refuses an allocation the others accept (or does not answer it) is left out of
    # the next attempts this long, doubled with each refusal in a row up to the max (see
    # leftout.py): shorter places an honest peer whose trouble passed sooner, at a failed
    # hand-out and a reconfiguration per refusal of a peer that keeps refusing.
    refused_backoff_s: float = 30.0
    refused_backoff_max_s: float = 600.0
    # Joined peers are taken in as a wave (joins.py): once no other peer joined for
    # join_settle_s, or the first of the wave waited join_wait_max_s. Shorter places a lone
    # joiner sooner, at a reconfiguration (a stop of the run) per join of a growing swarm.
    join_settle_s: float = 10.0
    join_wait_max_s: float = 60.0
    # An epoch's first drift check comes after this many of its predicted steps (and a few
    # seconds of gossip) where that is sooner than drift_check_s, so that the prediction is
    # re-estimated on the peers' own steps early (watch.py `first_drift_check_s`); 0: at
    # drift_check_s, as every later one.
    first_drift_steps: int = 2 * (GAUGE_SKIP_STEPS + GAUGE_STEPS)


@dataclass
class WallClock:
    """The machine's `now` + `offset`: wall-clock time, for records and the operators' signed
    times. The shell sets the offset once it knows it (`Coordinator.wall_offset`)."""

    offset: float = 0.0

    def wall(self, now: float) -> float:
        return now + self.offset


@dataclass(frozen=True)
class Reads:
    """What every part of the coordinator reads; `next_id` numbers the machine's requests (one
    sequence for all parts: procedures and operators' stops alike)."""

    me: bytes
    election: ElectionView
    epoch: EpochMachine
    swarm: Swarm
    planner: Planner
    timings: CoordinatorTimings
    operators: frozenset[bytes]
    clock: WallClock
    next_id: Callable[[], int]

    def ask(self, key: RequestKey, peers: Iterable[bytes], msg: int, body: dict, timeout_s: float) -> Ask:
        return ask(self.election, key, peers, msg, body, timeout_s)


def ask(election: ElectionView, key: RequestKey, peers: Iterable[bytes], msg: int, body: dict,
        timeout_s: float) -> Ask:
    """A request to `peers`; what only the recognised coordinator may ask carries its
    certificate (a peer outside the council hears no heartbeats and may not know this term's
    coordinator yet; it checks the certificate)."""
    cert = election.certificate
    if cert is not None and (msg == ControlMsg.STOP or (msg == ControlMsg.RUN_STATE and body.get("op") == "offer")):
        body = {**body, "cert": cert.to_wire()}
    return Ask(key, tuple(sorted(set(peers))), msg, body, timeout_s)


def named(alloc: Allocation) -> set[bytes]:
    """The peers an allocation places: its stages' and its spares."""
    return set(alloc.peers) | set(alloc.spares)
