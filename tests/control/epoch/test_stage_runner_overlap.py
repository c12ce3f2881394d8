"""The stage runner (control/epoch/runner.py) with DiLoCo's exchange overlapping the next inner
step (`dp_overlap_steps`): a run that ends with an exchange in flight, its checkpoint and its
one-step-back snapshot, and the next epoch completing that exchange (the payloads sent again
under the new epoch's tags) to the bits of the run that never stopped."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import trio

from dtfm.control.epoch.runner import StageRunner, StepReport
from dtfm.train import (PRESETS, TEST_CONFIG, Corpus, InMemoryHub, Plan, StageState, list_checkpoints,
                        load_checkpoint, parse_compression, run_step, stage_tensors)

SPEC = dataclasses.replace(PRESETS["tiny"], n_layer=2)
CFG = dataclasses.replace(TEST_CONFIG, global_batch_seqs=2, micro_batches=1)
CORPUS = Corpus(np.frombuffer(b"a small corpus for one stage " * 64, dtype=np.uint8).copy(), "corpus")
# every H = 2 steps from the first (after steps 1, 3, 5), each landing one step later (2, 4, 6)
COMP = parse_compression("diloco,inner_steps=2,dp_ramp_syncs=0,dp_overlap_steps=1")
PEERS = (b"p0", b"p1")


def steps(states: dict, plan: Plan, count: int) -> None:
    """`count` steps of every replica on a fresh in-memory network (a new epoch's comm)."""
    hub = InMemoryHub()
    with ThreadPoolExecutor(len(states)) as pool:
        for _ in range(count):
            for f in [pool.submit(run_step, states[p], plan, p, hub.endpoint(p), CORPUS) for p in PEERS]:
                f.result(timeout=60)


def anchors(states: dict) -> list[bytes]:
    return [states[p].compress.buffers["anchor"].numpy().tobytes() for p in PEERS]


def test_an_epoch_ending_mid_exchange_completes_it_in_the_next(tmp_path):
    assert COMP.in_flight(4) == 3 and COMP.apply_due(4) == 3
    plan = Plan(tuple((p,) for p in PEERS), ((0, SPEC.n_layer),), epoch=1)
    hub = InMemoryHub()
    states = {p: StageState(SPEC, CFG, (0, SPEC.n_layer), compression=COMP) for p in PEERS}
    seen: dict[bytes, list[StepReport]] = {p: [] for p in PEERS}
    runners = {p: StageRunner(states[p], plan, p, hub.endpoint(p), CORPUS, end_step=4, checkpoint_every=4,
                              checkpoint_dir=tmp_path / p.hex(), on_step=seen[p].append) for p in PEERS}
    ends = {}

    async def run_all():
        async def one(p):
            ends[p] = await runners[p].run()
        async with trio.open_nursery() as n:
            for p in PEERS:
                n.start_soon(one, p)
    trio.run(run_all)
    assert {(e.completed, e.failed) for e in ends.values()} == {(3, False)}
    # the exchange after step 3 is in flight: the weights differ, the anchor (landed after step 2) does not
    assert ends[PEERS[0]].params_sha256 != ends[PEERS[1]].params_sha256
    assert len(set(anchors(states))) == 1
    payload = states[PEERS[0]].compress.payload_bytes()
    for p in PEERS:  # sent once, on the synchronising steps
        assert [r.bytes_sent[2] for r in seen[p]] == [0, payload, 0, payload]
        [ck] = list_checkpoints(tmp_path / p.hex(), (0, SPEC.n_layer))
        saved = load_checkpoint(ck)
        assert saved.step == 4 and torch.equal(saved.compress.buffers["origin"], states[p].compress.buffers["origin"])

    # three ways on: the live stages in epoch 2 (the exchange of step 3 lands after step 4, its
    # payloads sent again under epoch 2's tags), the one-step-back snapshots (step 3 re-run in
    # epoch 2, sending on that comm, then the same two) and the checkpoints (epoch 3): the same bits
    from_checkpoint = {p: load_checkpoint(list_checkpoints(tmp_path / p.hex(), (0, SPEC.n_layer))[0])
                       for p in PEERS}
    back = {p: runners[p].snapshot_state() for p in PEERS}
    plan2 = dataclasses.replace(plan, epoch=2)
    steps(states, plan2, 2)
    assert len(set(anchors(states))) == 1
    steps(back, plan2, 3)
    steps(from_checkpoint, dataclasses.replace(plan, epoch=3), 2)
    for other in (back, from_checkpoint):
        for p in PEERS:
            for k, v in stage_tensors(states[p]).items():
                assert torch.equal(stage_tensors(other[p])[k], v), (p, k)
