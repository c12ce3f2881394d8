"""A run's progress as its coordinator tells it: `dtfm-peer train status [--follow] [RUN]` on
any daemon.

The daemon the operator asks (over its local control socket) answers from its own machines
when it is the coordinator, else asks the coordinator (RUN_STATE `progress`, which the
coordinator answers only to the peers of its run, as RUN_STATE `query`: control/epoch/access.py)
within `request_timeout_s`. The answer, a `RunProgress`, carries the run, its state, term and
epoch, the steps completed of how many, the step lines logged after the step the reader has
already seen (at most MAX_LINES, from the coordinator's recent lines), the coordinator's last
reconfigurations (at most MAX_RECONFIGS; a coordinator that took the run over knows its own
only) and, from them, the throughput and the time left (ETA: the median step time of the recent
lines times the steps left). `from_wire` checks every field: the answer crosses the network.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from dtfm.net import PEER_ID_BYTES, ProtocolError, get_bool, get_bytes, get_dict, get_float, get_int, get_list, get_str

from .allocation import RUN_ID_BYTES
from .events import Reconfiguration

__all__ = ["MAX_LINES", "MAX_RECONFIGS", "ProgressLine", "ProgressReconfig", "RunProgress", "run_progress"]

MAX_LINES = 64  # step lines in one answer (the coordinator keeps as many recent ones)
MAX_RECONFIGS = 8  # reconfigurations in one answer (and kept by the shell)
MAX_STEP = 2**62
MAX_SECONDS = 1e12
MAX_TEXT = 512  # a reason or trigger, cut to this many characters
STATES = ("idle", "handing out", "training", "stopping", "planning", "offering", "paused", "refused", "stopped",
          "finished")
ENDED = frozenset({"stopped", "finished", "refused"})


def _opt_float(d: dict, key: str) -> float | None:
    if d.get(key) is None:
        return None
    v = d[key]
    if type(v) is int:
        d = {key: float(v)}
    return get_float(d, key, -MAX_SECONDS, MAX_SECONDS)


@dataclass(frozen=True)
class ProgressLine:
    """One logged step."""

    step: int
    loss: float | None
    epoch: int
    iteration_s: float | None
    tokens_per_s: float | None

    @classmethod
    def of(cls, line: dict) -> ProgressLine:
        """From a line of the coordinator's own step log."""
        return cls(line["step"], line.get("loss"), line["epoch"], line.get("iteration_s"), line.get("tokens_per_s"))

    def to_wire(self) -> dict:
        return {"step": self.step, "loss": self.loss, "epoch": self.epoch, "iteration_s": self.iteration_s,
                "tokens_per_s": self.tokens_per_s}

    @classmethod
    def from_wire(cls, obj: object) -> ProgressLine:
        d = get_dict(obj, "progress line")
        loss = d.get("loss")
        if loss is not None and type(loss) is not float:  # NaN and inf are a diverged run's honest losses
            raise ProtocolError("progress line: loss must be a float or None")
        return cls(get_int(d, "step", 0, MAX_STEP), loss, get_int(d, "epoch", 0, MAX_STEP),
                   _opt_float(d, "iteration_s"), _opt_float(d, "tokens_per_s"))


@dataclass(frozen=True)
class ProgressReconfig:
    """One reconfiguration of the run, as the coordinator recorded it."""

    at: float  # wall time it completed
    epoch: int
    kind: str
    old_shape: str
    new_shape: str
    resume_step: int
    rollback: bool
    reason: str

    @classmethod
    def of(cls, r: Reconfiguration) -> ProgressReconfig:
        return cls(r.at, r.epoch, r.kind, r.old_shape, r.new_shape, r.resume_step, r.rollback, r.reason[:MAX_TEXT])

    def to_wire(self) -> dict:
        return {"at": self.at, "epoch": self.epoch, "kind": self.kind, "old_shape": self.old_shape,
                "new_shape": self.new_shape, "resume_step": self.resume_step, "rollback": self.rollback,
                "reason": self.reason}

    @classmethod
    def from_wire(cls, obj: object) -> ProgressReconfig:
        d = get_dict(obj, "progress reconfiguration")
        at = _opt_float(d, "at")
        if at is None:
            raise ProtocolError("progress reconfiguration: at is missing")
        return cls(at, get_int(d, "epoch", 0, MAX_STEP), get_str(d, "kind", 32), get_str(d, "old_shape", 32),
                   get_str(d, "new_shape", 32), get_int(d, "resume_step", 0, MAX_STEP), get_bool(d, "rollback"),
                   get_str(d, "reason", MAX_TEXT))


@dataclass(frozen=True)
class RunProgress:
    """The coordinator's account of its run (see the module docstring)."""

    run_id: bytes
    coordinator: bytes
    state: str
    term: int
    epoch: int
    shape: str  # "SxD"
    completed: int  # steps completed (the next step's index)
    steps: int  # of the run
    lines: tuple[ProgressLine, ...]  # logged after the step the reader asked from, oldest first
    reconfigurations: tuple[ProgressReconfig, ...]
    tokens_per_s: float | None  # the last logged step's
    eta_s: float | None  # the median step time of the coordinator's recent lines times the steps left
    reason: str = ""  # why it stopped, paused or stalls
    # an operator's stop: the steps the run has done when it ends (its peers run up to there
    # after the stop, so `completed` can still be below it in a `stopped` answer)
    stop_step: int | None = None

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def to_wire(self) -> dict:
        return {"run": self.run_id, "coordinator": self.coordinator, "state": self.state, "term": self.term,
                "epoch": self.epoch, "shape": self.shape, "completed": self.completed, "steps": self.steps,
                "lines": [x.to_wire() for x in self.lines],
                "reconfigurations": [r.to_wire() for r in self.reconfigurations], "tokens_per_s": self.tokens_per_s,
                "eta_s": self.eta_s, "reason": self.reason, "stop_step": self.stop_step}

    @classmethod
    def from_wire(cls, obj: object) -> RunProgress:
        """The progress in a decoded answer; raises only ProtocolError."""
        d = get_dict(obj, "progress")
        state = get_str(d, "state", 16)
        if state not in STATES:
            raise ProtocolError(f"progress: unknown state {state!r}")
        return cls(get_bytes(d, "run", RUN_ID_BYTES, RUN_ID_BYTES),
                   get_bytes(d, "coordinator", PEER_ID_BYTES, PEER_ID_BYTES), state,
                   get_int(d, "term", 0, 2**63 - 1), get_int(d, "epoch", 0, MAX_STEP), get_str(d, "shape", 32),
                   get_int(d, "completed", 0, MAX_STEP), get_int(d, "steps", 0, MAX_STEP),
                   tuple(ProgressLine.from_wire(x) for x in get_list(d, "lines", MAX_LINES)),
                   tuple(ProgressReconfig.from_wire(x) for x in get_list(d, "reconfigurations", MAX_RECONFIGS)),
                   _opt_float(d, "tokens_per_s"), _opt_float(d, "eta_s"), get_str(d, "reason", MAX_TEXT),
                   None if d.get("stop_step") is None else get_int(d, "stop_step", 0, MAX_STEP))


def run_progress(*, run_id: bytes, coordinator: bytes, state: str, term: int, epoch: int, shape: str,
                 completed: int, steps: int, recent: Iterable[dict], reconfigurations: Iterable[Reconfiguration],
                 after_step: int, reason: str = "", stop_step: int | None = None) -> RunProgress:
    """The coordinator's answer to a reader that has seen the steps up to `after_step` (-1:
    none): its recent lines after that step (the newest MAX_LINES), its last reconfigurations."""
    everything = [ProgressLine.of(x) for x in recent]
    lines = [x for x in everything if x.step > after_step][-MAX_LINES:]
    reconfigs = [ProgressReconfig.of(r) for r in reconfigurations][-MAX_RECONFIGS:]
    rate = next((x.tokens_per_s for x in reversed(everything) if x.tokens_per_s), None)
    times = [x.iteration_s for x in everything if x.iteration_s]
    eta = None if state in ENDED or not times else statistics.median(times) * max(0, steps - completed)
    return RunProgress(run_id, coordinator, state, term, epoch, shape, completed, steps, tuple(lines),
                       tuple(reconfigs), rate, eta, reason[:MAX_TEXT], stop_step)
