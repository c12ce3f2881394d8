"""The stage runner (control/epoch/runner.py) with DiLoCo's exchange overlapping the next inner
step (`dp_overlap_steps`): a run that ends with an exchange in flight, its checkpoint and its
one-step-back snapshot, and the next epoch completing that exchange (the payloads sent again
under the new epoch's tags) to the bits of the run that never stopped."""

from __future__ import annotations

import dataclasses

import torch
from stage_replicas import PEERS, SPEC, run_replicas, steps

from dtfm.train import list_checkpoints, load_checkpoint, parse_compression, stage_tensors

# every H = 2 steps from the first (after steps 1, 3, 5), each landing one step later (2, 4, 6)
COMP = parse_compression("diloco,inner_steps=2,dp_ramp_syncs=0,dp_overlap_steps=1")


def anchors(states: dict) -> list[bytes]:
    return [states[p].compress.buffers["anchor"].numpy().tobytes() for p in PEERS]


def test_an_epoch_ending_mid_exchange_completes_it_in_the_next(tmp_path):
    assert COMP.in_flight(4) == 3 and COMP.apply_due(4) == 3
    r = run_replicas(tmp_path, COMP)
    plan, states, runners, ends, seen = r.plan, r.states, r.runners, r.ends, r.seen
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
