"""The operator operations this peer took, per run, so that a copied stop, resume or
reschedule is never taken twice, not even after a restart (kept in the data dir as
`operations.json`, beside applied.json and stopped.json).

`TakenOps` holds, per run, the digest (sha256 of the signed body) and signed time of each
operation taken within the skew window (an older one is refused by its time anyway), and the
run's floor: the signed time of its last resume or reschedule, from the operations this peer
took and the allocations it applied (`Allocation.last_op_ms`). `check` is the one rule every
taker applies (the coordinator machine for stop, resume and reschedule, the epoch machine for a
run's final STOP): within the skew window of this peer's clock, signed after the floor, not
taken before. Bounded: MAX_OPS_PER_RUN operations per run, MAX_RUNS runs (the ones touched last).
Pure, but for `save_taken` / `load_taken`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from dtfm.files import atomic_write

from ..allocation import RUN_ID_BYTES
from ..operator import OperatorError, OperatorOp, SignedOp, check_after, check_time

__all__ = ["MAX_OPS_PER_RUN", "MAX_RUNS", "TAKEN_NAME", "TakenOps", "load_taken", "op_digest", "save_taken"]

logger = logging.getLogger(__name__)

TAKEN_NAME = "operations.json"
MAX_RUNS = 8  # runs whose operations are kept (the swarm resumes only its last one)
MAX_OPS_PER_RUN = 64  # operations of one run kept within the skew window (an operator signs them)
MAX_TIME_MS = 2**53


def op_digest(signed: SignedOp) -> str:
    """What names one operation: the sha256 of its signed body (one operation has one body)."""
    return hashlib.sha256(signed.body).hexdigest()


class _Run:
    def __init__(self, floor_ms: int = 0, ops: dict[str, int] | None = None):
        self.floor_ms = floor_ms  # signed time of the run's last resume or reschedule taken
        self.ops: dict[str, int] = dict(ops or {})  # digest -> signed time (ms)


class TakenOps:
    """The operations this peer took, per run (see the module docstring)."""

    def __init__(self) -> None:
        self._runs: dict[bytes, _Run] = {}  # oldest touched first
        self.version = 0  # grows with every change: the shell persists when it moved

    def floor_ms(self, run_id: bytes) -> int:
        run = self._runs.get(run_id)
        return run.floor_ms if run is not None else 0

    def taken(self, signed: SignedOp, run_id: bytes) -> bool:
        run = self._runs.get(run_id)
        return run is not None and op_digest(signed) in run.ops

    def check(self, op: OperatorOp, signed: SignedOp, *, now_s: float, skew_s: float, after_ms: int = 0) -> None:
        """OperatorError unless `op` (opened from `signed`) may be taken now: signed within
        `skew_s` of `now_s` (wall clock), after the run's floor (and `after_ms`, the floor the
        current allocation carries), and not taken before."""
        if self.taken(signed, op.run_id):
            raise OperatorError(f"this {op.kind} was taken already: sign a new one")
        check_time(op, now_s, skew_s)
        check_after(op, max(after_ms, self.floor_ms(op.run_id)))

    def take(self, op: OperatorOp, signed: SignedOp, *, now_s: float, skew_s: float) -> None:
        """Record `op` as taken; a resume or reschedule raises the run's floor to its time.
        Operations signed more than the skew window before `now_s` are forgotten (their time
        refuses them), and at most MAX_OPS_PER_RUN are kept (the newest)."""
        run = self._touch(op.run_id)
        horizon = int((now_s - skew_s) * 1000)
        run.ops = {d: t for d, t in run.ops.items() if t >= horizon}
        run.ops[op_digest(signed)] = op.issued_at_ms
        if len(run.ops) > MAX_OPS_PER_RUN:
            run.ops = dict(sorted(run.ops.items(), key=lambda kv: kv[1])[-MAX_OPS_PER_RUN:])
        if op.kind in ("resume", "reschedule"):
            run.floor_ms = max(run.floor_ms, op.issued_at_ms)
        self.version += 1

    def raise_floor(self, run_id: bytes, floor_ms: int) -> None:
        """An applied allocation's `last_op_ms`: the run's floor is at least that."""
        if floor_ms <= self.floor_ms(run_id):
            return
        self._touch(run_id).floor_ms = floor_ms
        self.version += 1

    def _touch(self, run_id: bytes) -> _Run:
        run = self._runs.pop(run_id, None) or _Run()
        self._runs[run_id] = run  # (the newest last)
        while len(self._runs) > MAX_RUNS:
            self._runs.pop(next(iter(self._runs)))
        return run

    # ---- the file -----------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"runs": [{"run": r.hex(), "floor_ms": run.floor_ms, "ops": run.ops} for r, run in self._runs.items()]}

    @classmethod
    def from_json(cls, obj: object) -> TakenOps:
        """The record in `obj` (ValueError when it is not one)."""
        out = cls()
        runs = obj.get("runs") if isinstance(obj, dict) else None
        if not isinstance(runs, list):
            raise ValueError("expected {\"runs\": [...]}")
        for entry in runs[-MAX_RUNS:]:
            if not isinstance(entry, dict):
                raise ValueError("a run entry is not a map")
            run, floor, ops = entry.get("run"), entry.get("floor_ms"), entry.get("ops")
            if not isinstance(run, str) or len(run) != 2 * RUN_ID_BYTES:
                raise ValueError(f"bad run id {run!r:.40}")
            if type(floor) is not int or not 0 <= floor <= MAX_TIME_MS:
                raise ValueError(f"bad floor_ms {floor!r:.40}")
            if not isinstance(ops, dict) or len(ops) > MAX_OPS_PER_RUN or not all(
                    isinstance(d, str) and len(d) == 64 and type(t) is int and 0 <= t <= MAX_TIME_MS
                    for d, t in ops.items()):
                raise ValueError("bad operations")
            out._runs[bytes.fromhex(run)] = _Run(floor, ops)
        return out


def save_taken(data_dir: Path, taken: dict) -> None:
    """Write `TakenOps.to_json()` atomically (a temporary file, fsynced, renamed)."""
    atomic_write(data_dir / TAKEN_NAME, json.dumps(taken))


def load_taken(data_dir: Path) -> TakenOps:
    """The operations this peer took before it restarted; an empty record when there is no
    file. A damaged file is ignored with a warning: the allocation's floor (applied.json) and
    the skew window still refuse what matters most (a stop from before the last resume)."""
    path = data_dir / TAKEN_NAME
    try:
        return TakenOps.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return TakenOps()
    except (OSError, ValueError) as e:
        logger.warning("%s is damaged (%s): ignored", path, e)
        return TakenOps()
