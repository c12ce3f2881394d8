"""Reconfiguration scenarios as traces of the plane's machines under a virtual clock
(`PlaneSim`, control/testing/sim.py): a follower killed, the coordinator killed and restarted with its
data dir, two of a data-parallel group at once, a 3 | 5 partition with the coordinator in the
minority, both holders of a stage lost and restored from checkpoints, and both holders of a
stage lost before any checkpoint (the swarm rolls back to the initial weights), and a swarm
paused by a partition that writes what it holds to disk, so both holders of a stage killed
while it waits cost nothing.

Each scenario is a short script; its trace (the plane's events in time order, the merged step
log, each node's final state; optionally the messages one node sent and received, as in
follower_killed_as_the_coordinator_saw_it) is compared with tests/data/plane_traces/NAME.txt,
which a reader can check against the protocol in docs/control.md. After a deliberate change of behaviour,
re-record with `DTFM_RECORD_TRACES=1 pytest tests/control/plane/test_plane_traces.py` and read the diff.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from dtfm.control import ControlMsg, SignedAllocation
from dtfm.control.election import ElectionConfig
from dtfm.control.testing.election_sim import NetConditions
from dtfm.control.testing.sim import PlaneSim
from paths import DATA

TRACES = DATA / "plane_traces"
RECORD = os.environ.get("DTFM_RECORD_TRACES") == "1"
CFG = ElectionConfig.test()
EVENT_FIELDS = ("term", "epoch", "kind", "old_shape", "new_shape", "resume_step", "rollback", "reason", "trigger")


class WatchedSim(PlaneSim):
    """A PlaneSim that keeps the plane's messages to and from one node, `watch` (None: no node),
    as they are delivered (through the simulation's message hook)."""

    def __init__(self, *args, **kw):
        self.watch: int | None = None
        self.messages: list[tuple[float, int, int, tuple]] = []  # (time, from, to, payload)
        super().__init__(*args, **kw)

    def _on_message(self, k: int, src: int, payload: tuple) -> None:
        if self.watch in (k, src):
            self.messages.append((self.now, src, k, payload))
        super()._on_message(k, src, payload)


class Script:
    """Drives a PlaneSim and writes down what happened, in words: the plane's events, the
    operator's notes and, when the sim watches a node, the messages it sent and received."""

    def __init__(self, sim: WatchedSim):
        self.sim = sim
        self.lines: list[str] = []
        self._events = 0
        self._left = 0
        self._messages = 0

    def name(self, peer: bytes) -> str:
        return f"n{self.sim.index[peer]}"

    def _names(self, text: str) -> str:
        for p in self.sim.ids:
            text = text.replace(p.hex()[:8], self.name(p))
        return text

    def note(self, what: str) -> None:
        self._flush()
        self.lines.append(f"{self.sim.now:8.3f}  > {what}")

    def _flush(self) -> None:
        """The plane's events and the nodes that went (a planned leave) since the last flush, in
        time order."""
        new: list[tuple[float, str]] = []
        for t, k, event, fields in self.sim.events[self._events:]:
            shown = " ".join(f"{f}={self._names(str(fields[f]))}" for f in EVENT_FIELDS if f in fields)
            if fields.get("rollback"):  # where the stages came from, and the completed steps run again
                shown += f" restored_from={fields['restored_from']} steps_lost={fields['steps_lost']}"
            new.append((t, f"{t:8.3f}  n{k} {event} {shown}"))
        for t, k, how in self.sim.left[self._left:]:
            new.append((t, f"{t:8.3f}  n{k} went: {how}"))
        for t, src, dst, payload in self.sim.messages[self._messages:]:
            new.append((t, f"{t:8.3f}    n{src} -> n{dst} {self._message(payload)}"))
        self.lines += [line for _, line in sorted(new, key=lambda x: x[0])]
        self._events, self._left, self._messages = len(self.sim.events), len(self.sim.left), len(self.sim.messages)

    def _message(self, payload: tuple) -> str:
        """A message of the plane in words: a request (ask), its answer, or a one-way send."""
        if payload[0] == "answer":
            return f"answer {self._wire(payload[2])}"
        msg, body = payload[-2], payload[-1]
        if msg == ControlMsg.ALLOCATION:
            a = SignedAllocation.from_wire(body).open()
            grid = " | ".join(" ".join(self.name(p) for p in pipe) for pipe in a.pipelines)
            return f"ALLOCATION term {a.term} epoch {a.epoch} steps {a.start_step}..{a.end_step} [{grid}]"
        return f"{ControlMsg(msg).name} {self._wire(body)}".rstrip()

    def _wire(self, v) -> str:
        """A wire value, short: ids by name, a digest by its first 8 digits, a nested record in
        parentheses, a list of records or of more than 4 values by its length."""
        if isinstance(v, bytes):
            return self._names(v.hex()[:8]) if len(v) <= 32 else f"<{len(v)} bytes>"
        if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
            return v[:8]
        if isinstance(v, list | tuple):
            if len(v) > 4 or any(isinstance(x, list | tuple | dict) for x in v):
                return f"<{len(v)} items>"
            return "[" + " ".join(self._wire(x) for x in v) + "]"
        if isinstance(v, dict):
            return " ".join(f"{k}=({self._wire(x)})" if isinstance(x, dict) else f"{k}={self._wire(x)}"
                            for k, x in v.items() if k != "run")
        if isinstance(v, float):
            return f"{v:g}"
        return str(v)

    def run(self, seconds: float) -> None:
        self.sim.run_for(seconds)
        self._flush()

    def train(self, steps: int, **kw) -> int:
        done = self.sim.train(steps, **kw)
        self.note(f"train {steps}: {done} steps completed")
        return done

    def coordinator(self) -> int:
        [c] = self.sim.coordinators()
        return c

    def finish(self) -> str:
        self._flush()
        sim = self.sim
        merged = sim.merged_log()
        steps = sorted(merged)
        back = [s for s in steps if merged[s].get("backfilled")]
        self.lines.append(f"log: steps {steps[0] if steps else '-'}..{steps[-1] if steps else '-'}, "
                          f"{len(steps)} steps, back-filled {back}")
        assert steps == list(range(len(steps))), f"holes in the log: {steps}"
        for k in range(sim.n):
            if sim.nodes[k] is None:
                self.lines.append(f"n{k}: down")
                continue
            run = sim.epoch(k).run
            if run is None:
                self.lines.append(f"n{k}: no run")
                continue
            where = "spare"
            if k in [sim.index[p] for p in run.alloc.peers]:
                d, s = run.alloc.position(sim.ids[k])
                where = f"stage {s} of pipeline {d}"
            self.lines.append(f"n{k}: {sim.nodes[k].role.value} term {sim.nodes[k].term}, epoch "
                              f"{run.alloc.epoch} {run.phase.value}, {where}, at step {run.at}")
        assert sim.violations == [], sim.violations
        return "\n".join(self.lines) + "\n"


def _started(n: int, *, seed: int, stages: int = 2, checkpoint_every: int = 0,
             watch_coordinator: bool = False) -> tuple[Script, int]:
    s = Script(WatchedSim(n, CFG, seed=seed, stages=stages, checkpoint_every=checkpoint_every,
                          conditions=NetConditions(jitter=1.0)))
    s.run(2.0)
    c = s.coordinator()
    if watch_coordinator:
        s.note(f"the messages of n{c}, the coordinator, are shown from here on (indented)")
        s.sim.watch = c
    s.note(f"train start on n{c}")
    s.sim.start_training(c)
    s.run(0.5)
    return s, c


def follower_killed(*, watch_coordinator: bool = False) -> str:
    s, c = _started(4, seed=3, watch_coordinator=watch_coordinator)
    s.train(3)
    s.run(0.5)
    k = next(j for j in range(4) if j != c)
    s.note(f"n{k} is killed")
    s.sim.crash(k)
    s.train(1)
    s.run(2.0)
    s.train(3)
    s.run(0.5)
    return s.finish()


def follower_killed_as_the_coordinator_saw_it() -> str:
    """`follower_killed` with the coordinator's messages: what it asked, what it was told."""
    return follower_killed(watch_coordinator=True)


def coordinator_killed_and_restarted() -> str:
    s, c = _started(5, seed=4)
    s.train(3)
    s.run(0.5)
    s.note(f"the coordinator n{c} is killed")
    s.sim.crash(c)
    s.train(1)
    s.run(3.0)
    s.train(2)
    s.run(0.5)
    s.note(f"n{c} restarts with its data dir")
    s.sim.restart(c)
    s.run(3.0)
    s.train(2)
    s.run(0.5)
    return s.finish()


def two_of_a_dp_group() -> str:
    s, c = _started(6, seed=5)
    s.train(2)
    s.run(0.5)
    alloc = s.sim.epoch(c).current
    assert alloc is not None and alloc.dp >= 2
    lost = [s.sim.index[alloc.pipelines[d][0]] for d in range(2)]
    if c in lost:  # keep the coordinator: this scenario is about the stage's replicas
        lost = [s.sim.index[alloc.pipelines[d][1]] for d in range(2)]
    s.note(f"n{lost[0]} and n{lost[1]}, two replicas of one stage, are killed at once")
    for k in lost:
        s.sim.crash(k)
    s.train(1)
    s.run(2.0)
    s.train(2)
    s.run(0.5)
    return s.finish()


def partition_coordinator_in_minority() -> str:
    s, c = _started(8, seed=6)
    s.train(2)
    s.run(0.5)
    # (the coordinator and two others, peers outside the council first: the other five hold a
    # quorum of the council of seven, 5, and go on)
    council = s.sim.node(c).voters
    others = sorted((j for j in range(8) if j != c), key=lambda j: (s.sim.ids[j] in council, j))
    minority = [c] + others[:2]
    s.note(f"partition: n{', n'.join(map(str, minority))} | the other five")
    s.sim.partition([1 if k in minority else 0 for k in range(8)])
    s.train(1)
    s.run(4.0)
    s.train(2)
    s.run(0.5)
    s.note("heal")
    s.sim.heal()
    s.run(4.0)
    s.train(2)
    s.run(0.5)
    return s.finish()


def _kill_a_stage(s: Script, c: int, what: str) -> list[int]:
    """After 5 steps, every holder of a stage the coordinator n`c` does not hold is killed
    (`what` says so); their node numbers."""
    s.train(5)
    s.run(0.5)
    alloc = s.sim.epoch(c).current
    assert alloc is not None
    stage = 1 if alloc.position(s.sim.ids[c])[1] == 0 else 0
    lost = [s.sim.index[alloc.pipelines[d][stage]] for d in range(alloc.dp)]
    s.note(what.format(stage=stage, nodes=", ".join(f"n{k}" for k in lost)))
    for k in lost:
        s.sim.crash(k)
    return lost


def _both_holders_of_a_stage_lost(*, checkpoint_every: int | None, when: str, restart: str, after: int) -> str:
    """Both holders of a stage the coordinator does not hold are killed after step 5, and
    restart with their data dirs; the swarm trains `after` steps more."""
    s, c = _started(4, seed=7, **({} if checkpoint_every is None else {"checkpoint_every": checkpoint_every}))
    lost = _kill_a_stage(s, c, "both holders of stage {stage} ({nodes}) are killed" + when)
    s.train(1)
    s.run(2.0)
    s.note(f"they restart with their data dirs ({restart})")
    for k in lost:
        s.sim.restart(k)
    s.run(4.0)
    s.train(after)
    s.run(0.5)
    return s.finish()


def stage_restored_from_checkpoints() -> str:
    return _both_holders_of_a_stage_lost(checkpoint_every=2, when="", restart="their checkpoints", after=2)


def stage_lost_before_any_checkpoint() -> str:
    return _both_holders_of_a_stage_lost(checkpoint_every=None, when=" before any checkpoint",
                                         restart="no checkpoint: step 0 is rebuilt from the seed", after=7)


def a_return_after_a_rollback_runs_nothing_again() -> str:
    """Both holders of a stage die before any checkpoint, the coordinator not among them: the
    survivors roll back to the initial weights and train on. When the two come back, their
    return is a reconfiguration from the steps the survivors hold, not a rollback: nothing the
    current line of steps completed is run again (the steps the first rollback undid were
    counted by it)."""
    s, c = _started(8, seed=7, stages=4)
    lost = _kill_a_stage(s, c, "every holder of stage {stage} ({nodes}) is killed before any checkpoint")
    s.train(1)
    s.run(4.0)
    s.train(2)
    s.run(0.5)
    s.note("they restart with their data dirs and join")
    for k in lost:
        s.sim.restart(k)
    s.run(6.0)
    s.train(2)
    s.run(0.5)
    return s.finish()


def a_paused_swarm_keeps_what_it_holds() -> str:
    s, c = _started(4, seed=7)
    s.train(5)
    s.run(0.5)
    alloc = s.sim.epoch(c).current
    assert alloc is not None
    stage = 1 if alloc.position(s.sim.ids[c])[1] == 0 else 0
    holders = [s.sim.index[alloc.pipelines[d][stage]] for d in range(alloc.dp)]
    side = [c, holders[0]] if holders[0] != c else [c, holders[1]]
    s.note(f"partition: n{side[0]}, n{side[1]} | the other two (no side has a quorum of the four voters); "
           "nothing is checkpointed periodically")
    s.sim.partition([1 if k in side else 0 for k in range(4)])
    s.train(1)
    s.run(6.0)
    kept = sorted((k, step) for k in range(4) for (_, _, step) in s.sim.checkpoints[k])
    s.note(f"on disk while the swarm waits (node, step): {kept}")
    s.note(f"both holders of stage {stage} (n{holders[0]}, n{holders[1]}) are killed, then restarted; heal")
    for k in holders:
        s.sim.crash(k)
    for k in holders:
        s.sim.restart(k)
    s.sim.heal()
    s.run(6.0)
    s.train(2)
    s.run(0.5)
    return s.finish()


def planned_leaves() -> str:
    s, c = _started(5, seed=8)
    s.train(3)
    s.run(0.5)
    alloc = s.sim.epoch(c).current
    assert alloc is not None
    k = next(s.sim.index[p] for p in alloc.peers if s.sim.index[p] != c)
    s.note(f"n{k}, a stage peer, leaves (dtfm-peer leave)")
    s.sim.leave(k)
    s.run(3.0)
    s.train(2)
    s.run(0.5)
    s.note(f"the coordinator n{c} leaves")
    s.sim.leave(c)
    s.run(4.0)
    s.train(2)
    s.run(0.5)
    return s.finish()


SCENARIOS: dict[str, Callable[[], str]] = {f.__name__: f for f in (
    follower_killed, follower_killed_as_the_coordinator_saw_it, coordinator_killed_and_restarted, two_of_a_dp_group, partition_coordinator_in_minority,
    stage_restored_from_checkpoints, stage_lost_before_any_checkpoint, a_return_after_a_rollback_runs_nothing_again,
    a_paused_swarm_keeps_what_it_holds,
    planned_leaves)}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_trace(name):
    got = SCENARIOS[name]()
    path = TRACES / f"{name}.txt"
    if RECORD:
        TRACES.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
    want = path.read_text()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), "recorded", "now"))
        pytest.fail(f"the trace of {name} changed (re-record with DTFM_RECORD_TRACES=1 if that is meant):\n{diff}")
