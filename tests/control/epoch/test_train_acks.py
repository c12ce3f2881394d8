"""A training step does not wait for the acknowledgements of its own sends (train/worker.py):
the next step waits for them before it changes the state, the stage runner before a checkpoint
and where the run ends; a send that failed fails the next step, or the run's end."""

from __future__ import annotations

import collections
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import trio

from dtfm.control.epoch.runner import StageRunner
from dtfm.train import (
    CommError,
    CommTimeout,
    Corpus,
    GPTSpec,
    InMemoryComm,
    InMemoryHub,
    LocalCluster,
    PendingSends,
    Plan,
    StageState,
    TrainConfig,
    all_reduce_small,
    list_checkpoints,
    load_checkpoint,
    parse_compression,
    run_step,
)

SPEC = GPTSpec("acks", n_layer=4, n_embd=32, n_head=4, seq_len=16)
CFG = TrainConfig(global_batch_seqs=8, micro_batches=2, lr=3e-3, comm_timeout_s=5.0)
CORPUS = Corpus(np.frombuffer(b"a small corpus for deferred acknowledgements " * 64, dtype=np.uint8).copy(), "c")


def step_of(tag: str) -> int:
    return int(tag.split("/", 1)[0].split(".")[1])  # "<epoch>.<step>/..."


class AckGate:
    """Acknowledgements held back: those of step k's sends come only once some peer sent a
    tensor of step k + 1 (or `open` lets them go); a wait for a send in `refuse` ((peer, step))
    fails as a send the receiver never took."""

    def __init__(self, refuse=()):
        self.refuse = set(refuse)
        self._lock = threading.Lock()
        self._opened: dict[int, threading.Event] = collections.defaultdict(threading.Event)

    def opened(self, step: int) -> threading.Event:
        with self._lock:
            return self._opened[step]

    def open(self, step: int) -> None:
        self.opened(step).set()


class GatedHandle:
    def __init__(self, gate: AckGate, me, step: int, what: str):
        self.gate, self.me, self.step, self.what = gate, me, step, what

    def wait(self, timeout_s: float) -> None:
        if not self.gate.opened(self.step + 1).wait(timeout_s):
            raise CommTimeout(f"no acknowledgement to {self.what} within {timeout_s} s")
        if (self.me, self.step) in self.gate.refuse:
            raise CommError(f"the receiver did not take {self.what}")


class GatedComm(InMemoryComm):
    def __init__(self, hub: GatedHub, me):
        super().__init__(hub, me)
        self.gate = hub.gate

    def isend(self, peer, tag, tensor):
        super().isend(peer, tag, tensor)
        step = step_of(tag)
        self.gate.open(step)  # step `step` has started somewhere: step - 1's acknowledgements come
        return GatedHandle(self.gate, self.me, step, f"send {tag!r} to {peer!r}")


class GatedHub(InMemoryHub):
    def __init__(self, gate: AckGate):
        super().__init__()
        self.gate = gate

    def endpoint(self, me):
        return GatedComm(self, me)


@pytest.mark.parametrize("tied, compress", [(True, "exact"), (False, "cocktail")])
def test_a_step_goes_on_before_its_sends_are_acknowledged(tied, compress):
    # Every send of step k is acknowledged only once step k + 1 has started somewhere: a step
    # that waited for its own acknowledgements would never end (here: CommTimeout after 5 s).
    # The training is bit for bit the same as with acknowledgements at once.
    spec = dataclasses.replace(SPEC, tied_head=tied)
    comp = parse_compression(compress)
    plan = Plan.grid(spec.n_layer, 2, 2)
    with LocalCluster(spec, CFG, plan, CORPUS, compression=comp) as cl:
        want = cl.run(3)
        want_params = {p: [t.clone() for t in st.params.values()] for p, st in cl.states.items()}
    gate = AckGate()
    with LocalCluster(spec, CFG, plan, CORPUS, compression=comp) as cl:
        cl.hub = GatedHub(gate)
        assert cl.run(3) == want
        for p, st in cl.states.items():
            assert all(torch.equal(a, b) for a, b in zip(st.params.values(), want_params[p]))
        with pytest.raises(CommTimeout):  # the last step's acknowledgements are still held
            cl.settle(timeout_s=0.01)


def test_a_send_that_failed_fails_the_next_step_which_changes_nothing():
    # 1 pipeline of 2 stages: the gradient stage 1 sends upstream in step 1 is never taken.
    # Stage 1 completes step 1 (it has everything it needs) and fails step 2 before changing
    # anything; stage 0 received all of step 2 and completed it: the two stand one step apart,
    # as the runner's one-step-back snapshot lets the swarm undo (control/epoch/runstate.py).
    plan = Plan.grid(SPEC.n_layer, 2, 1)
    first, last = plan.pipeline(0)
    gate = AckGate(refuse={(last, 1)})
    hub = GatedHub(gate)
    states = {p: StageState(SPEC, CFG, plan.layer_ranges[plan.position(p)[1]]) for p in plan.peers}
    pending = {p: PendingSends() for p in plan.peers}

    def step_all():
        with ThreadPoolExecutor(2) as pool:
            futs = {p: pool.submit(run_step, states[p], plan, p, hub.endpoint(p), CORPUS, pending=pending[p])
                    for p in plan.peers}
            out = {}
            for p, f in futs.items():
                try:
                    out[p] = f.result(timeout=30)
                except CommError as e:
                    out[p] = e
            return out

    for _ in range(2):
        assert not any(isinstance(r, Exception) for r in step_all().values())
    assert all(len(pending[p]) > 0 for p in plan.peers)  # left for the next step
    before = {n: t.clone() for n, t in states[last].params.items()}
    moments = {k: v.clone() for k, v in states[last].optim.state_tensors().items()}
    norm = states[last].last_grad_norm
    got = step_all()
    assert isinstance(got[last], CommError) and "did not take" in str(got[last])
    assert states[last].step == 2 and states[last].last_grad_norm == norm
    assert all(torch.equal(t, before[n]) for n, t in states[last].params.items())
    assert all(torch.equal(v, moments[k]) for k, v in states[last].optim.state_tensors().items())
    assert not isinstance(got[first], Exception) and states[first].step == 3


class Refused:
    def __init__(self, what: str):
        self.what = what

    def wait(self, timeout_s: float) -> None:
        raise CommError(f"the receiver did not take {self.what}")


class RefusingComm(InMemoryComm):
    """Every send of step `refuse_step` fails when its handle is waited for."""

    refuse_step = -1

    def isend(self, peer, tag, tensor):
        handle = super().isend(peer, tag, tensor)
        return Refused(f"send {tag!r} to {peer!r}") if step_of(tag) == self.refuse_step else handle


class RefusingHub(InMemoryHub):
    def __init__(self, me, refuse_step: int):
        super().__init__()
        self.me, self.refuse_step = me, refuse_step

    def endpoint(self, me):
        comm = RefusingComm(self, me)
        comm.refuse_step = self.refuse_step if me == self.me else -1
        return comm


def test_the_run_ends_failed_when_its_last_steps_send_failed(tmp_path):
    # 2 replicas of one stage, checkpointing every step: a's sends of its last step (1) fail.
    # The runner waits for them where the run ends: a's run ends failed with step 1 completed
    # (its snapshot is the stage before it), and no checkpoint holds step 1: a checkpoint is
    # written only once the sends of the steps it holds were acknowledged.
    a, b = b"a" * 4, b"b" * 4
    plan = Plan(((a,), (b,)), ((0, SPEC.n_layer),), epoch=0)
    hub = RefusingHub(a, refuse_step=1)
    states = {p: StageState(SPEC, CFG, (0, SPEC.n_layer)) for p in (a, b)}
    runners = {p: StageRunner(states[p], plan, p, hub.endpoint(p), CORPUS, end_step=2, checkpoint_every=1,
                              checkpoint_dir=tmp_path / p.hex()) for p in (a, b)}
    ends = {}

    async def run_all():
        async def one(p):
            ends[p] = await runners[p].run()
        async with trio.open_nursery() as n:
            for p in (a, b):
                n.start_soon(one, p)

    trio.run(run_all)
    assert (ends[b].completed, ends[b].failed) == (1, False)
    assert (ends[a].completed, ends[a].failed) == (1, True)
    assert "a tensor of step 1 was not acknowledged" in ends[a].reason
    assert states[a].step == 2 and runners[a].snapshot_step == 1
    saved = {p: [load_checkpoint(c).step for c in list_checkpoints(tmp_path / p.hex(), (0, SPEC.n_layer))]
             for p in (a, b)}
    assert saved == {a: [1], b: [1, 2]}


@pytest.mark.parametrize("deferred", [True, False])
def test_a_collective_leaves_its_handles_or_waits_for_them(deferred):
    # Every send of step 0 fails once waited for: a collective that waits fails; one that leaves
    # its handles in `pending` has its result, and `pending.wait` raises instead.
    hub, group = InMemoryHub(), ["x", "y"]
    comms = {p: RefusingComm(hub, p) for p in group}
    for c in comms.values():
        c.refuse_step = 0
    pending = {p: PendingSends() if deferred else None for p in group}

    def member(i, p):
        return all_reduce_small(comms[p], group, torch.tensor([1.0 + i], dtype=torch.float64), "0.0/loss", 5.0,
                                pending[p])

    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(member, i, p) for i, p in enumerate(group)]
        if not deferred:
            for f in futs:
                with pytest.raises(CommError, match="did not take"):
                    f.result(timeout=30)
            return
        assert [f.result(timeout=30).item() for f in futs] == [3.0, 3.0]
    for p in group:
        assert len(pending[p]) == 1
        with pytest.raises(CommError, match="did not take"):
            pending[p].wait(1.0)
        assert len(pending[p]) == 0
