"""What each peer holds of a run, and the step a reconfigured swarm resumes from.

A peer answers the coordinator's RUN_STATE query with a `PeerRunState`: the (term, epoch) it
applied, the layer range of its stage, the step its stage is at (`at`: the next step it would
run), the step of the snapshot it keeps from before its last step (`prev`: it can roll back one
step), whether its stage is still running, its newest checkpoints, and its last step reports.

`resume_point` is the coordinator's pure decision. Peers of one epoch are within one step of
each other (every step ends in all-reduces that couple them), but a step that failed half-way
can leave some replicas of a stage one step ahead of the others. The swarm resumes from the
newest step at which *every* stage of the layout can be restored by some reachable peer: in
memory (its stage or its snapshot), failing that from a checkpoint, and failing that from the
run's initial weights. Step 0 is a checkpoint every peer of the run can rebuild (from the run's
seed, or the `--init-from` folder every peer holds; the holders' digests are compared as any
offer's), so a run that lost every holder of a stage before its first checkpoint rolls back to
step 0, exactly, rather than wait for weights that are gone. The resume point says which source
its oldest stage came from (`source`). The protocol is in docs/control.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dtfm.net import ProtocolError, get_bool, get_dict, get_int, get_list, short_id

from .report import StepReport

__all__ = ["MAX_CHECKPOINTS", "MAX_REPORTS", "PeerRunState", "ResumeError", "ResumePoint", "Source", "describe", "resume_point"]

MAX_REPORTS = 256  # step reports a peer keeps and sends with its run state (~30 KB)
MAX_CHECKPOINTS = 16  # a peer's newest checkpoints it lists in its run state
MAX_STEP = 2**63 - 1
MAX_LAYER = 1 << 16


class ResumeError(Exception):
    """No reachable peer of the run answered: there is nobody to restore its stages."""


@dataclass(frozen=True)
class PeerRunState:
    run_id: bytes | None  # the run of the last applied allocation, None: none
    term: int
    epoch: int
    layers: tuple[int, int] | None  # the range of its stage in that allocation; None: a spare
    at: int | None  # its stage's next step (steps 0 .. at-1 applied); None: no stage built
    prev: int | None  # the step of its one-step-back snapshot, None: none
    running: bool  # its stage worker is still stepping
    checkpoints: tuple[tuple[int, int, int], ...] = ()  # (first layer, end layer, step)
    reports: tuple[StepReport, ...] = ()

    def to_wire(self) -> dict:
        return {"run": self.run_id or b"", "term": self.term, "epoch": self.epoch,
                "layers": list(self.layers) if self.layers else None, "at": self.at, "prev": self.prev,
                "running": self.running, "checkpoints": [list(c) for c in self.checkpoints],
                "reports": [r.to_wire() for r in self.reports]}

    @classmethod
    def from_wire(cls, obj: object) -> PeerRunState:
        """Validate a peer's answer; raises only ProtocolError."""
        d = get_dict(obj, "run state")
        run = d.get("run")
        if type(run) is not bytes or len(run) not in (0, 16):
            raise ProtocolError("run state: run must be 16 bytes or empty")
        layers = d.get("layers")
        if layers is not None:
            layers = _pair(layers, "layers")
        ckpts = []
        for c in get_list(d, "checkpoints", MAX_CHECKPOINTS):
            items = get_list({"c": c}, "c", 3)
            if len(items) != 3:
                raise ProtocolError("run state: a checkpoint is [first, end, step]")
            k = dict(zip("abs", items))
            ckpts.append((get_int(k, "a", 0, MAX_LAYER), get_int(k, "b", 1, MAX_LAYER), get_int(k, "s", 0, MAX_STEP)))
        reports = [StepReport.from_wire(r) for r in get_list(d, "reports", MAX_REPORTS)]
        return cls(run or None, get_int(d, "term", 0, MAX_STEP), get_int(d, "epoch", 0, MAX_STEP), layers,
                   _opt_int(d, "at"), _opt_int(d, "prev"), get_bool(d, "running"), tuple(ckpts), tuple(reports))

    def steps_held(self) -> set[int]:
        """Steps at which this peer holds its stage in memory."""
        return {s for s in (self.at, self.prev) if s is not None}


class Source(enum.Enum):
    """Where the stages of a resume point come from, the most costly source any stage needs."""

    MEMORY = "memory"  # every stage in some peer's memory (its stage or its one-step-back snapshot)
    CHECKPOINT = "checkpoint"  # some stage from a checkpoint on disk
    INITIAL = "initial"  # some stage rebuilt from the run's initial weights (step 0)


@dataclass(frozen=True)
class ResumePoint:
    step: int  # the step the new epoch starts with: every stage is held at it
    memory: dict[tuple[int, int], tuple[bytes, ...]]  # layer range -> peers holding it in memory at `step`
    checkpoint: dict[tuple[int, int], tuple[bytes, ...]] = field(default_factory=dict)  # -> peers with a checkpoint
    rollback: bool = False  # some stage is restored from a checkpoint or the initial weights: the swarm goes back
    initial: dict[tuple[int, int], tuple[bytes, ...]] = field(default_factory=dict)  # -> peers that rebuild it

    def holders(self, layers: tuple[int, int]) -> tuple[bytes, ...]:
        return self.memory.get(layers, ()) or self.checkpoint.get(layers, ()) or self.initial.get(layers, ())

    @property
    def source(self) -> Source:
        return Source.INITIAL if self.initial else Source.CHECKPOINT if self.checkpoint else Source.MEMORY


def resume_point(run_id: bytes, layer_ranges: tuple[tuple[int, int], ...],
                 states: dict[bytes, PeerRunState]) -> ResumePoint:
    """The newest step at which every stage of `layer_ranges` can be restored by a peer of
    `states` (the reachable ones): in memory first, else from checkpoints, else (step 0) from
    the run's initial weights, which every peer of the run rebuilds. ResumeError when no peer of
    the run answered."""
    mine = {p: s for p, s in states.items() if s.run_id == run_id}
    if not mine:
        raise ResumeError(f"no reachable peer has applied an allocation of run {run_id.hex()[:8]}")
    held: dict[tuple[int, int], dict[int, list[bytes]]] = {r: {} for r in layer_ranges}
    saved: dict[tuple[int, int], dict[int, list[bytes]]] = {r: {} for r in layer_ranges}
    for peer, s in sorted(mine.items()):
        if s.layers in held:
            for step in s.steps_held():
                held[s.layers].setdefault(step, []).append(peer)
    for peer, s in sorted(mine.items()):  # a peer's checkpoints are of the run it reports
        for a, b, step in s.checkpoints:
            if (a, b) in saved:
                saved[(a, b)].setdefault(step, []).append(peer)
    common = set.intersection(*(set(h) for h in held.values())) if held else set()
    if common:
        step = max(common)
        return ResumePoint(step, {r: tuple(held[r][step]) for r in layer_ranges})
    # (step 0 is always restorable: every peer of the run rebuilds the initial weights)
    step = max(set.intersection(*[set(held[r]) | set(saved[r]) | {0} for r in layer_ranges]))
    rebuilders = tuple(sorted(mine))
    return ResumePoint(step, {r: tuple(held[r][step]) for r in layer_ranges if step in held[r]},
                       {r: tuple(saved[r][step]) for r in layer_ranges if step not in held[r] and step in saved[r]},
                       rollback=True,
                       initial={r: rebuilders for r in layer_ranges if step not in held[r] and step not in saved[r]})


def describe(states: dict[bytes, PeerRunState]) -> str:
    """One line for a log: peer -> layers@at."""
    return ", ".join(f"{short_id(p)}:{'spare' if s.layers is None else f'{s.layers[0]}-{s.layers[1] - 1}'}@{s.at}"
                     for p, s in sorted(states.items()))


def _pair(obj: object, what: str) -> tuple[int, int]:
    items = get_list({what: obj}, what, 2)
    if len(items) != 2:
        raise ProtocolError(f"run state: {what} must be [first, end]")
    d = dict(zip("ab", items))
    a, b = get_int(d, "a", 0, MAX_LAYER), get_int(d, "b", 1, MAX_LAYER)
    if b <= a:
        raise ProtocolError(f"run state: empty {what}")
    return a, b


def _opt_int(d: dict, key: str) -> int | None:
    if d.get(key) is None:
        return None
    return get_int(d, key, 0, MAX_STEP)

