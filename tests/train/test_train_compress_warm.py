"""DiLoCo's warm start (`dp_ramp_syncs`): which steps synchronise, that the replicas are the same
bits after each of them, and that the schedule survives the config's texts, checkpoints,
resumption and stage transfer mid-ramp (it is a function of the step alone)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from compress_cluster import CFG, SPEC, replica_hashes
from hypothesis import given
from hypothesis import strategies as st

from dtfm.train import (LocalCluster, Plan, load_checkpoint, load_corpus, save_checkpoint, stage_from_tensors,
                        stage_tensors)
from dtfm.train.compress import (COMPRESSION_PRESETS, CompressionConfig, StageCompression, get_compression,
                                 parse_compression)

# H = 4, two synchronisations at each interval below it (1, 2), then every 4 steps
RAMP = CompressionConfig(pp_method="int4", pp_hadamard=True, dp_method="diloco", dp_topk_fraction=1.0,
                         dp_value_bits=2, dp_chunk_elems=1024, inner_steps=4, dp_ramp_syncs=2)
RAMP_SYNCS = [0, 1, 3, 5, 9, 13, 17]  # steps after whose update the replicas synchronise


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=256 << 10)


@pytest.mark.parametrize("config, steps, want", [
    (RAMP, 18, RAMP_SYNCS),
    # H = 16, one synchronisation at each of 1, 2, 4, 8 (15 steps), then every 16
    (dataclasses.replace(RAMP, inner_steps=16, dp_ramp_syncs=1), 48, [0, 2, 6, 14, 30, 46]),
    # H = 6 (not a power of two): intervals 1, 2, 4, then 6
    (dataclasses.replace(RAMP, inner_steps=6, dp_ramp_syncs=1), 20, [0, 2, 6, 12, 18]),
    # three exact warm-up steps first: the ramp starts after them
    (dataclasses.replace(RAMP, dp_warmup_steps=3), 21, [3, 4, 6, 8, 12, 16, 20]),
    # no ramp: every H from the first local step, as before
    (dataclasses.replace(RAMP, dp_ramp_syncs=0), 12, [3, 7, 11]),
    # H = 1: nothing to ramp
    (dataclasses.replace(RAMP, inner_steps=1), 3, [0, 1, 2]),
    # cocktail synchronises every step after the warm-up; exact never
    (dataclasses.replace(RAMP, dp_method="cocktail", dp_warmup_steps=2), 5, [2, 3, 4]),
    (CompressionConfig(), 5, []),
])
def test_ramp_schedule(config, steps, want):
    assert [k for k in range(steps) if config.sync_due(k)] == want
    assert config.syncs_in(steps) == len(want)


def test_ramp_periods_and_span():
    assert RAMP.ramp_periods == (1, 2) and RAMP.ramp_steps == 6
    slow = get_compression("slow-link")
    assert slow.ramp_periods == (1, 2, 4, 8) and slow.ramp_steps == 15 * slow.dp_ramp_syncs
    assert dataclasses.replace(RAMP, dp_ramp_syncs=0).ramp_periods == ()
    assert dataclasses.replace(RAMP, dp_method="cocktail").ramp_periods == ()


@given(h=st.integers(1, 40), k=st.integers(0, 5), warm=st.integers(0, 5))
def test_ramp_schedule_equals_its_intervals(h, k, warm):
    """The synchronisations are those of the intervals laid end to end: k of each power of two
    below H, then H for ever, counted from the first step after the exact warm-up."""
    config = dataclasses.replace(RAMP, inner_steps=h, dp_ramp_syncs=k, dp_warmup_steps=warm)
    intervals, p = [], 1
    while k and p < h:
        intervals += [p] * k
        p *= 2
    intervals += [h] * 400
    want, at = [], warm - 1
    for gap in intervals:
        at += gap
        want.append(at)
    steps = warm + k * 2 * h + 3 * h
    assert [s for s in range(steps) if config.sync_due(s)] == [s for s in want if s < steps]


def test_presets_warm_start_and_byte_budget():
    """Both DiLoCo presets ramp; over 3,000 steps the ramp's extra synchronisations keep the DP
    bytes at least 50x below the exact all-reduce's (each synchronisation's payload is H / 128.6
    of an exact step's in `tiny` 2 x 4: 2-bit values, all-gather of 4)."""
    for name in ("diloco", "slow-link"):
        c = get_compression(name)
        assert c.dp_ramp_syncs > 0 and "warm start" in c.describe()
        exact_steps_bytes = 3000 * 20_868_096  # `tiny` 2 x 4, fp32 ring all-reduce, counted
        sync_bytes = 2_631_888  # one synchronisation of `tiny` 2 x 4: 12 payloads (counted, docs/compression.md)
        assert exact_steps_bytes / (c.syncs_in(3000) * sync_bytes) >= 50


def test_ramp_validation_and_texts():
    for bad in (-1, 1025, True, 1.5):
        with pytest.raises(ValueError):
            dataclasses.replace(RAMP, dp_ramp_syncs=bad)
    for c in (RAMP, get_compression("diloco"), get_compression("slow-link"),
              dataclasses.replace(get_compression("diloco"), dp_ramp_syncs=0)):
        assert parse_compression(c.to_spec()) == c
        assert CompressionConfig.from_dict(c.to_dict()) == c
    assert parse_compression("diloco,dp_ramp_syncs=3").dp_ramp_syncs == 3
    assert "warm start: 2 syncs each every 1, 2 steps (6 steps)" in RAMP.describe()
    assert "warm start" not in dataclasses.replace(RAMP, dp_ramp_syncs=0).describe()
    old = {k: v for k, v in get_compression("diloco").to_dict().items() if k != "dp_ramp_syncs"}
    assert CompressionConfig.from_dict(old).dp_ramp_syncs == 0  # a description written before the field


def test_replicas_identical_after_each_ramp_sync(corpus):
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 3), corpus, compression=RAMP) as cl:
        for step in range(14):
            cl.step()
            synced = step in RAMP_SYNCS
            for s in range(2):
                assert (len(set(replica_hashes(cl, s))) == 1) == synced, (step, s)
            assert (cl.last_step_bytes["dp"] > 0) == synced, step


class SoloComm:
    """A group of one: the all-gather returns this member's own payload."""
    me = "solo"


def synced_anchor(config: CompressionConfig, step: int) -> tuple[torch.Tensor, StageCompression]:
    gen = torch.Generator().manual_seed(5)
    params = {"w": torch.nn.Parameter(torch.randn(30, 40, generator=gen) * 0.1)}
    sc = StageCompression(config, params, 0)
    with torch.no_grad():
        params["w"].sub_(torch.randn(30, 40, generator=gen) * 0.01)  # a local step
    sc.sync(SoloComm(), ["solo"], list(params.values()), seed=0, step=step, tag="0.0/dpc", timeout_s=1.0)
    return sc.buffers["anchor"].clone(), sc


def test_a_ramp_sync_is_a_plain_average_and_an_h_sync_the_outer_step():
    plain = dataclasses.replace(RAMP, dp_ramp_syncs=0, outer_lr=1.0, outer_momentum=0.0)
    ramp_anchor, sc = synced_anchor(RAMP, 3)  # step 3: the ramp's interval 2
    assert torch.equal(ramp_anchor, synced_anchor(plain, 3)[0])
    assert float(sc.buffers["outer_m"].abs().sum()) == 0.0
    h_anchor, sc = synced_anchor(RAMP, 9)  # step 9: the first at interval H
    assert not torch.equal(h_anchor, synced_anchor(plain, 9)[0])
    assert float(sc.buffers["outer_m"].abs().sum()) > 0.0


def test_ramp_syncs_average_and_the_outer_optimizer_starts_at_h(corpus):
    """The warm start's synchronisations (after steps 0, 1, 3, 5) set every replica to the mean
    of the replicas' decoded weights and leave the outer momentum at zero; the first at interval
    H (after step 9) takes the Nesterov outer step and starts the momentum."""
    assert [k for k in range(14) if RAMP.ramp_sync(k)] == [0, 1, 3, 5]
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 3), corpus, compression=RAMP) as cl:
        for step in range(10):
            cl.step()
            moms = [cl.states[p].compress.buffers["outer_m"] for p in cl.plan.dp_group(0)]
            if step < 9:
                assert all(float(m.abs().sum()) == 0.0 for m in moms), step
        assert all(float(m.abs().sum()) > 0.0 for m in moms)
        assert len(set(replica_hashes(cl, 0))) == 1


def test_checkpoint_mid_ramp_carries_the_schedule(tmp_path, corpus):
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 2), corpus, compression=RAMP) as cl:
        cl.run(3)  # mid-ramp: the next sync is after step 3
        st_ = cl.states["peer1.1"]
    back = load_checkpoint(save_checkpoint(tmp_path, st_))
    assert back.compress.config == RAMP and back.step == 3
    assert [k for k in range(back.step, 14) if back.compress.sync_due(k)] == [3, 5, 9, 13]


def test_resume_mid_ramp_equals_not_stopping(corpus):
    plan = Plan.grid(4, 2, 2)
    with LocalCluster(SPEC, CFG, plan, corpus, compression=RAMP) as cl:
        straight = cl.run(11)
        want = {s: replica_hashes(cl, s) for s in range(2)}
    with LocalCluster(SPEC, CFG, plan, corpus, compression=RAMP) as cl:
        losses = cl.run(4)  # stop between the ramp's syncs after steps 3 and 5
        saved = {p: ({k: v.clone() for k, v in stage_tensors(s_).items()}, s_.step, s_.optim.step_count)
                 for p, s_ in cl.states.items()}
    states = {p: stage_from_tensors(SPEC, CFG, plan.layer_ranges[plan.position(p)[1]], t, step, ostep,
                                    compression=RAMP) for p, (t, step, ostep) in saved.items()}
    with LocalCluster(SPEC, CFG, plan, corpus, compression=RAMP, states=states) as cl:
        losses += cl.run(7)
        assert losses == straight
        assert {s: replica_hashes(cl, s) for s in range(2)} == want


def test_stage_transfer_mid_ramp_keeps_the_schedule(corpus):
    """A third pipeline joins after the ramp's sync at step 3 (its stages fetched by the transfer
    encoding): every replica, new ones included, synchronises at the ramp's steps after it."""
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 2, prefix="a"), corpus, compression=RAMP) as cl:
        cl.run(4)
        cl.reconfigure(Plan.grid(4, 2, 3, prefix="a"))
        assert cl.states["a2.1"].step == 4
        for step in range(4, 14):
            cl.step()
            synced = step in RAMP_SYNCS
            for s in range(2):
                assert (len(set(replica_hashes(cl, s))) == 1) == synced, (step, s)
            assert (cl.last_step_bytes["dp"] > 0) == synced, step


def test_every_preset_round_trips():
    for name, c in COMPRESSION_PRESETS.items():
        assert parse_compression(c.to_spec()) == c, name
