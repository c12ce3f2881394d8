"""The plane's status: one typed snapshot built from the machines' own, serialised in one place
(`PlaneStatus.to_wire`, what `dtfm-peer status` shows under "training" and `dtfm-swarm` reads).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtfm.train import StageMemory

from .coordinator.phase import CoordinatorStatus, Phase, run_word
from .epoch.disk import DiskStatus
from .epoch.machine import EpochPhase, EpochStatus
from .epoch.report import BYTE_AXES

__all__ = ["PlaneStatus", "plane_status"]

# The coordinator's phases its own header shows while its epoch is not under way.
_RUN_STATES_SHOWN = frozenset({Phase.PAUSED, Phase.PLANNING, Phase.OFFERING, Phase.REFUSED, Phase.STOPPED,
                               Phase.FINISHED})


@dataclass(frozen=True)
class PlaneStatus:
    me: bytes
    election: dict[str, Any]  # ElectionService.status()
    is_coordinator: bool
    epoch: EpochStatus
    coordinator: CoordinatorStatus
    log_path: Path
    swarm_wait: dict | None
    pid: int
    now: float = 0.0  # wall time of the snapshot
    refusals: dict[str, int] = field(default_factory=dict)  # refused input per reason (control/refusals.py)
    disk: DiskStatus | None = None  # this peer's checkpoints on disk
    stage_memory: StageMemory | None = None  # the current stage's own state, as of its last step
    data_bytes: int | None = None  # the data set, once this peer loaded it (with its first allocation)

    def state(self) -> str:
        """What this peer is doing: idle, spare, waiting (restarted: it holds no stage of the run
        it was placed in), building, accepted, training (stalled, on the coordinator, while the
        run's step is overdue), or how its last epoch ended (finished, stopped, or the failure's
        text as `stopped`). A run that is over without finishing (an operator's train stop, or
        one that cannot go on) is `stopped` on every peer that knows it.
        On the coordinator of the run, while this peer's own epoch is not under way, the run's
        state: paused, planning, offering, refused, stopped or finished (one word for the peer and
        the run it issued, never "stopped" beside a run that is "paused"), as `run_word` names it."""
        e = self.epoch
        if e.phase is None:
            return "idle"
        active = e.phase in (EpochPhase.BUILDING, EpochPhase.ACCEPTED, EpochPhase.TRAINING)
        if e.run_stopped:  # (its runner goes on to the stop's step boundary)
            return "stopping" if active and e.end is None else "stopped"
        c = self.coordinator
        if not active and self._issued() and c.phase in _RUN_STATES_SHOWN:
            return run_word(e, c)
        if e.phase is EpochPhase.ENDED and e.end is not None:
            return "stopped" if e.end.failed else e.end.reason
        if e.phase is EpochPhase.ENDED:
            return "stopped"
        if e.phase is EpochPhase.REFUSED:
            return "stopped"
        if e.phase is EpochPhase.TRAINING and c.phase is Phase.TRAINING and c.stalled_since is not None:
            return "stalled"  # the coordinator of a run whose step is overdue
        return e.phase.value

    def _issued(self) -> bool:
        """This peer issued the run its epoch belongs to (it is, or was, that run's coordinator)."""
        a, c = self.epoch.alloc, self.coordinator
        return a is not None and c.run_id == a.run_id and c.phase is not Phase.IDLE

    def to_wire(self) -> dict[str, Any]:
        el = self.election
        out: dict[str, Any] = {"state": self.state(), "election": el, "role": el["role"], "term": el["term"],
                               "coordinator": el["coordinator"]}
        if self.data_bytes is not None:
            out["data_bytes"] = self.data_bytes
        e = self.epoch
        a = e.alloc
        if a is not None:
            out.update({"run_id": a.run_id.hex(), "epoch": a.epoch, "issuer": a.issuer.hex(),
                        "preset": a.preset, "stages": a.stages, "dp": a.dp, "end_step": a.end_step,
                        "start_step": a.start_step, "predicted_iteration_s": a.predicted_iteration_s,
                        "epoch_reason": a.reason, "tokens_per_step": a.train.global_batch_seqs * a.model.seq_len,
                        "compression": a.compression.to_spec(),
                        "compression_details": a.compression.describe() + (
                            f"; {a.compress_links.describe(a.compression)}" if a.compress_links is not None else ""),
                        # the whole allocation, for `dtfm-peer members`: who holds which stage
                        "pipelines": [[p.hex() for p in pipe] for pipe in a.pipelines],
                        "layer_ranges": [list(r) for r in a.layer_ranges], "spares": [p.hex() for p in a.spares],
                        "voters": [p.hex() for p in a.voters]})
            if self.me in a.peers:
                d, s = a.position(self.me)
                pipe = a.pipelines[d]
                out.update({"stage": s, "pipeline": d, "layers": list(a.layer_ranges[s]),
                            "prev": pipe[s - 1].hex() if s > 0 else None,
                            "next": pipe[s + 1].hex() if s + 1 < a.stages else None,
                            "dp_group": [p[s].hex() for p in a.pipelines], "fetched_bytes": e.fetched_bytes})
            elif not self.is_coordinator:
                out["role"] = "spare"
            if e.step is not None:
                out["step"] = e.step
            if e.restored:  # from applied.json: what this peer knew before it restarted
                out["restored"] = True
            if e.heard is not None:  # how the restored run ended, as its coordinator told
                out["run_ended"] = {"state": e.heard[0], "steps_done": e.heard[1]}
            if e.run_stopped:  # the run is over without finishing
                out["run_stopped"] = True
            last = e.last_report
            if last is not None:
                out["last_step"] = {"step": last.step, "loss": last.loss, "iteration_s": last.iteration_s,
                                    "compute_s": last.compute_s, "pipeline_s": last.pipeline_s,
                                    "sync_s": last.sync_s}
                if any(last.bytes_sent):
                    out["last_step"]["bytes_sent"] = dict(zip(BYTE_AXES, last.bytes_sent))
            if self.stage_memory is not None:
                out["memory"] = self.stage_memory.to_wire()
        if e.last_end is not None:
            out["last_end"] = e.last_end
        c = self.coordinator
        if c.last_reconfig is not None:
            out["last_reconfig"] = c.last_reconfig.to_wire()
        if c.run_id is not None and c.phase is not Phase.IDLE:
            out["issued"] = {"run_id": c.run_id.hex(), "state": c.phase.value, "reason": c.reason,
                             "completed": c.completed, "end_step": c.end_step, "log": str(self.log_path),
                             # steps 0..completed are done: `completed` is a step index, this a count
                             "steps_done": None if c.completed is None else c.completed + 1,
                             "recent": list(c.recent), "started_at": c.started_at, "epoch": c.epoch}
            if c.stalled_since is not None:  # a training run that makes no progress says so, and why
                if c.phase is Phase.TRAINING:
                    out["issued"]["state"] = "stalled"
                out["issued"].update(reason=c.stalled_reason, stalled_s=max(0.0, self.now - c.stalled_since))
            if c.cut_links:
                out["issued"]["cut_links"] = c.cut_links
            if c.left_out:  # peers that refused an allocation: not placed until the time shown
                out["issued"]["left_out"] = [x.to_wire() for x in c.left_out]
            if c.kept_out:  # joined peers outside the run: the scheduler found it no faster with them
                out["issued"]["kept_out"] = [p.hex() for p in c.kept_out]
            if c.counts is not None:  # what this coordinator counted of the run (the run's /metrics)
                out["issued"]["counts"] = c.counts.to_wire()
        if self.swarm_wait is not None:
            out["waiting_for_peers"] = dict(self.swarm_wait)
        out["refusals"] = dict(self.refusals)
        if self.disk is not None:
            out["checkpoints"] = self.disk.to_wire()
        out["pid"] = self.pid
        return out


def plane_status(me: bytes, election: dict, is_coordinator: bool, epoch: EpochStatus,
                 coordinator: CoordinatorStatus, log_path: Path, swarm_wait: dict | None,
                 refusals: dict[str, int] | None = None, disk: DiskStatus | None = None,
                 stage_memory: StageMemory | None = None, data_bytes: int | None = None) -> PlaneStatus:
    return PlaneStatus(me, election, is_coordinator, epoch, coordinator, log_path, swarm_wait, os.getpid(), time.time(),
                       dict(refusals or {}), disk, stage_memory, data_bytes)
