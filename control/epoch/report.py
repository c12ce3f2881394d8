"""A peer's step reports and how its stage's run ended: the figures the runner thread hands to
the epoch machine, the coordinator's step log and `dtfm-peer status`. Light types (no torch), so
the machines that read them load without the stage's code (control/epoch/runner.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dtfm.net import ProtocolError, get_dict, get_float, get_int, get_list

__all__ = ["BYTE_AXES", "MAX_STEP_BYTES", "REPORTS_NOTE", "RunEnd", "StepReport"]

REPORTS_NOTE = "step_reports"  # the checkpoint note with the step reports of the steps it holds

MAX_STEP = 2**63 - 1
MAX_SECONDS = 1e9
MAX_STEP_BYTES = 2**53  # bytes a peer reports sending on one axis in one step
BYTE_AXES = ("pp_fwd", "pp_bwd", "dp", "other")  # train/compress `AXES`, in the report's order


@dataclass(frozen=True)
class StepReport:
    """What a peer tells the issuer (and its own status) about one completed step."""

    epoch: int
    step: int
    loss: float | None  # global mean loss, on last stages only
    iteration_s: float  # this peer's wall time for the step
    compute_s: float
    pipeline_s: float
    sync_s: float
    # Payload bytes this peer sent in the step per axis (BYTE_AXES: pipeline forward, pipeline
    # backward, data-parallel, other); all 0 when not counted (a report of an older version).
    bytes_sent: tuple[int, int, int, int] = (0, 0, 0, 0)
    # compute_s's CPU time in the stage's thread (what it took with a core to itself); 0: not
    # measured (a GPU stage, several torch threads, a report of an older version)
    compute_cpu_s: float = 0.0

    @property
    def core_share(self) -> float | None:
        """The share of a core the stage's compute got in the step (CPU time over wall time,
        at most 1); None where not measured."""
        if not (self.compute_cpu_s > 0 and self.compute_s > 0):
            return None
        return min(1.0, self.compute_cpu_s / self.compute_s)

    def to_wire(self) -> dict:
        out: dict[str, object] = {"epoch": self.epoch, "step": self.step, "loss": self.loss, "iteration_s": self.iteration_s,
               "compute_s": self.compute_s, "pipeline_s": self.pipeline_s, "sync_s": self.sync_s}
        if any(self.bytes_sent):
            out["bytes"] = list(self.bytes_sent)
        if self.compute_cpu_s:
            out["compute_cpu_s"] = self.compute_cpu_s
        return out

    @classmethod
    def from_wire(cls, obj: object) -> StepReport:
        """A report from the network; raises only ProtocolError. The loss may be any float (a
        diverging run reports inf or nan, and that is worth logging, not a protocol error);
        `bytes`, when present, is one integer in [0, MAX_STEP_BYTES] per axis; `compute_cpu_s`,
        when present, a number in [0, MAX_SECONDS]."""
        d = get_dict(obj, "step report")
        loss = d.get("loss")
        if loss is not None and type(loss) not in (int, float):
            raise ProtocolError("step report: loss must be a number or null")
        sent = (0, 0, 0, 0)
        if "bytes" in d:
            items = get_list(d, "bytes", len(BYTE_AXES))
            if len(items) != len(BYTE_AXES):
                raise ProtocolError(f"step report: bytes must list {len(BYTE_AXES)} counts ({', '.join(BYTE_AXES)})")
            counts = dict(zip(BYTE_AXES, items))
            try:
                sent = tuple(get_int(counts, k, 0, MAX_STEP_BYTES) for k in BYTE_AXES)  # type: ignore[assignment]
            except ProtocolError as e:
                raise ProtocolError(f"step report: bytes: {e}") from None
        iteration_s, compute_s, pipeline_s, sync_s = (get_float(d, k, 0.0, MAX_SECONDS)
                                                      for k in ("iteration_s", "compute_s", "pipeline_s", "sync_s"))
        cpu_s = get_float(d, "compute_cpu_s", 0.0, MAX_SECONDS) if "compute_cpu_s" in d else 0.0
        return cls(get_int(d, "epoch", 0, MAX_STEP), get_int(d, "step", 0, MAX_STEP),
                   None if loss is None else float(loss), iteration_s, compute_s, pipeline_s, sync_s, sent, cpu_s)


@dataclass(frozen=True)
class RunEnd:
    """How a stage's run ended: `completed` is the last step this peer completed (-1: none)."""

    completed: int
    reason: str  # "finished", "stopped", or what failed
    failed: bool
    params_sha256: str = ""  # of the stage's parameters at the end: DP replicas must agree
    # a failure of this peer's own (an exception of its step: out of memory, a bug), not a lost
    # peer or the coordinator's abort for a reconfiguration, which the swarm heals by itself
    on_this_peer: bool = False

    @property
    def log_level(self) -> int:
        """INFO for a run that finished or stopped, WARNING for one another peer or the
        coordinator ended (the coordinator reconfigures: nothing for the operator to do here),
        ERROR for this peer's own failure."""
        if not self.failed:
            return logging.INFO
        return logging.ERROR if self.on_this_peer else logging.WARNING
