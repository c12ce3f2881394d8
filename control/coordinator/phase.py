"""The coordinator's phase, its status snapshot, and the one decision of what the run is in a
word: `run_word` and `run_over` (pure), which the coordinator, the plane's operator front and
`dtfm-peer status` (control/status.py) all ask.

The facts they read have one owner each: whether the run is over without finishing is the epoch
machine's (`EpochStatus.run_stopped`; the coordinator tells it with `RunClosed`), the phase of
the run this peer handed out is the coordinator's (`CoordinatorStatus.phase`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..epoch.machine import EpochStatus
from ..events import LeftOutPeer, Reconfiguration
from .counters import RunCounts

__all__ = ["IN_PROGRESS", "OVER", "CoordinatorStatus", "Phase", "run_over", "run_word"]


class Phase(enum.Enum):
    IDLE = "idle"  # no run handed out by this peer
    HANDING_OUT = "handing out"
    TRAINING = "training"
    STOPPING = "stopping"  # a reconfiguration stops the epoch at a common step boundary
    PLANNING = "planning"  # resume point and the new layout
    OFFERING = "offering"  # holders offer the stages at the resume step
    PAUSED = "paused"  # some stage has no reachable holder: waits for one
    REFUSED = "refused"  # a peer refused the hand-out
    STOPPED = "stopped"  # the run cannot go on
    FINISHED = "finished"


OVER = frozenset({Phase.FINISHED, Phase.STOPPED})  # the phases of a run that is over
# the phases of a run that trains or is being reconfigured: a new start waits for it
IN_PROGRESS = frozenset({Phase.TRAINING, Phase.STOPPING, Phase.PLANNING, Phase.OFFERING, Phase.PAUSED})


@dataclass(frozen=True)
class CoordinatorStatus:
    """A typed snapshot for `status`: the epoch this peer handed out, and its last
    reconfiguration."""

    phase: Phase
    run_id: bytes | None
    epoch: int | None
    reason: str
    completed: int | None
    end_step: int | None
    recent: tuple[dict, ...]
    started_at: float | None
    last_reconfig: Reconfiguration | None
    stalled_since: float | None = None  # wall time of the last progress of a run that makes none
    stalled_reason: str = ""
    cut_links: str = ""  # links left out of allocations until measured healthy again
    left_out: tuple[LeftOutPeer, ...] = ()  # peers left out of allocations because they refused one
    counts: RunCounts | None = None  # what this coordinator counted of the run (control/coordinator/counters.py)
    kept_out: tuple[bytes, ...] = ()  # joined peers the scheduler keeps outside the run (it is not faster with them)


def run_word(epoch: EpochStatus, coordinator: CoordinatorStatus) -> str:
    """The run this peer coordinates in one word (control/progress.py's STATES): the
    coordinator's phase, except that a run this peer's epoch machine holds over (no run here, over
    without finishing, or its stage ran the last step) while the coordinator is still at work on it
    is "stopped"."""
    if coordinator.phase in OVER or not epoch.run_over:
        return coordinator.phase.value
    return Phase.STOPPED.value


def run_over(epoch: EpochStatus, coordinator: CoordinatorStatus) -> bool:
    """Whether the run of this peer's current epoch is over: nothing to reconfigure, stop or
    resize. Over where the epoch machine says so (`EpochStatus.run_over`), and where this peer
    coordinates that run and logged its last step."""
    alloc = epoch.alloc
    return epoch.run_over or (alloc is not None and coordinator.run_id == alloc.run_id
                              and run_word(epoch, coordinator) == Phase.FINISHED.value)
