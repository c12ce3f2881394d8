"""What each peer holds of a run, and the step a reconfigured swarm resumes from.

A peer answers the coordinator's RUN_STATE query with a `PeerRunState`: the (term, epoch) it
applied, the layer range of its stage, the step its stage is at (`at`: the next step it would
run), the step of the snapshot it keeps from before its last step (`prev`: it can roll back one
step), whether its stage is still running, its newest checkpoints, and its last step reports.

`resume_point` is the coordinator's pure decision. Peers of one epoch are within one step of
each other (every step ends in all-reduces that couple them), but a step that failed half-way
can leave some replicas of a stage one step ahead of the others. The swarm resumes from the
newest step at which *every* stage of the layout is held by some reachable peer, in memory
(its stage or its snapshot) or, failing that, in a checkpoint: the swarm then rolls back to the
newest step every stage has a checkpoint of. When some stage is held nowhere, there is no
resume point and training stops with the reason: weights are never silently re-initialised.
The protocol is in docs/control.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtfm.net import ProtocolError, get_bool, get_dict, get_int, get_list, short_id

from .report import StepReport

__all__ = ["MAX_REPORTS", "PeerRunState", "ResumeError", "ResumePoint", "describe", "resume_point"]

MAX_REPORTS = 256  # step reports a peer keeps and sends with its run state (~30 KB)
MAX_CHECKPOINTS = 16
MAX_STEP = 2**63 - 1
MAX_LAYER = 1 << 16


class ResumeError(Exception):
    """No step at which every stage is held: the run cannot go on."""


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


@dataclass(frozen=True)
class ResumePoint:
    step: int  # the step the new epoch starts with: every stage is held at it
    memory: dict[tuple[int, int], tuple[bytes, ...]]  # layer range -> peers holding it in memory at `step`
    checkpoint: dict[tuple[int, int], tuple[bytes, ...]] = field(default_factory=dict)  # -> peers with a checkpoint
    rollback: bool = False  # some stage is restored from a checkpoint: the swarm goes back to `step`

    def holders(self, layers: tuple[int, int]) -> tuple[bytes, ...]:
        return self.memory.get(layers, ()) or self.checkpoint.get(layers, ())


def resume_point(run_id: bytes, layer_ranges: tuple[tuple[int, int], ...],
                 states: dict[bytes, PeerRunState]) -> ResumePoint:
    """The newest step at which every stage of `layer_ranges` is held by a peer of `states`
    (the reachable ones), in memory first, else from checkpoints. ResumeError when none."""
    mine = {p: s for p, s in states.items() if s.run_id == run_id}
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
    both = [set(held[r]) | set(saved[r]) for r in layer_ranges]
    common = set.intersection(*both) if both else set()
    if common:
        step = max(common)
        return ResumePoint(step, {r: tuple(held[r][step]) for r in layer_ranges if step in held[r]},
                           {r: tuple(saved[r][step]) for r in layer_ranges if step not in held[r]}, rollback=True)
    lost = [r for r in layer_ranges if not held[r] and not saved[r]]
    if lost:
        names = ", ".join(f"layers {a}-{b - 1}" for a, b in lost)
        raise ResumeError(f"no reachable peer holds {names} and no peer has a checkpoint of "
                          f"{'it' if len(lost) == 1 else 'them'}: training cannot go on without re-initialising "
                          "weights, which it never does")
    detail = "; ".join(f"layers {a}-{b - 1} at steps {sorted(set(held[(a, b)]) | set(saved[(a, b)]))}"
                       for a, b in layer_ranges)
    raise ResumeError(f"the stages are held at no common step ({detail}): training cannot go on")


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

