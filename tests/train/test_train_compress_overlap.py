"""DiLoCo's synchronisation overlapped with the next inner steps (`dp_overlap_steps`): when each
exchange lands, the delayed outer update as a pure function, the synchronised model (the anchor)
the same bits on every replica, and a stop, resumption or stage transfer while an exchange is
in flight giving the run that never stopped."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from compress_cluster import CFG, SPEC, replica_hashes

from dtfm.control.allocation.fields import config_from_wire, config_to_wire
from dtfm.train import (LocalCluster, Plan, load_checkpoint, load_corpus, save_checkpoint, stage_from_tensors,
                        stage_tensors)
from dtfm.train.compress import CompressionConfig, StageCompression, get_compression, parse_compression
from dtfm.train.compress import delayed_outer_update, outer_step

# H = 4, two synchronisations at each interval below it (1, 2), then every 4 steps
RAMP = CompressionConfig(pp_method="int4", pp_hadamard=True, dp_method="diloco", dp_topk_fraction=1.0,
                         dp_value_bits=2, dp_chunk_elems=1024, inner_steps=4, dp_ramp_syncs=2, outer_lr=0.7,
                         outer_momentum=0.8)
RAMP_SYNCS = [0, 1, 3, 5, 9, 13, 17]  # steps after whose update a synchronisation is sent
OVER = dataclasses.replace(RAMP, dp_overlap_steps=2)
# the step each sync lands after: the gap to the next sync bounds the overlap (1 at interval 1)
OVER_APPLIES = {0: 1, 1: 3, 3: 5, 5: 7, 9: 11, 13: 15, 17: 19}


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=256 << 10)


def test_overlap_schedule():
    assert [OVER.overlap_of(k) for k in RAMP_SYNCS] == [OVER_APPLIES[k] - k for k in RAMP_SYNCS]
    assert [k for k in range(20) if OVER.overlap_of(k)] == RAMP_SYNCS[:7]
    assert {k: OVER.apply_due(k) for k in range(20) if OVER.apply_due(k) is not None} == \
        {v: k for k, v in OVER_APPLIES.items() if v < 20}
    # in flight when step k starts: sent before k, landing at k or later
    assert [OVER.in_flight(k) for k in range(8)] == [None, 0, 1, 1, 3, 3, 5, 5]
    assert all(RAMP.overlap_of(k) == 0 and RAMP.apply_due(k) is None and RAMP.in_flight(k) is None
               for k in range(20))
    long = dataclasses.replace(OVER, dp_ramp_syncs=0, dp_overlap_steps=9)  # capped at the gap H = 4
    assert [long.overlap_of(k) for k in (3, 7, 11)] == [4, 4, 4] and long.apply_due(7) == 3


def test_overlap_validation_texts_and_wire():
    for bad in (-1, 65, True, 1.5):
        with pytest.raises(ValueError):
            dataclasses.replace(OVER, dp_overlap_steps=bad)
    with pytest.raises(ValueError, match="diloco"):
        dataclasses.replace(get_compression("cocktail"), dp_overlap_steps=1)
    with pytest.raises(ValueError, match="diloco"):
        CompressionConfig(dp_overlap_steps=1)
    c = parse_compression("slow-link,dp_overlap_steps=2")
    assert c.dp_overlap_steps == 2 and parse_compression(c.to_spec()) == c
    assert CompressionConfig.from_dict(c.to_dict()) == c
    assert "exchange overlapping 2 inner steps" in c.describe()
    assert "overlapping" not in get_compression("slow-link").describe()
    old = {k: v for k, v in c.to_dict().items() if k != "dp_overlap_steps"}
    assert CompressionConfig.from_dict(old).dp_overlap_steps == 0  # a description written before the field
    # on the wire only where it is not 0, so an allocation without it keeps its bytes and decodes
    assert "dp_overlap_steps" not in config_to_wire(get_compression("slow-link"), "compression")
    wire = config_to_wire(c, "compression")
    assert wire["dp_overlap_steps"] == 2 and config_from_wire(CompressionConfig, wire, "compression") == c
    older = {k: v for k, v in wire.items() if k != "dp_overlap_steps"}
    assert config_from_wire(CompressionConfig, older, "compression").dp_overlap_steps == 0


def _tensors(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("step", [3, 9])  # a warm-start average, then the Nesterov outer step
def test_delayed_outer_update_is_the_outer_step_plus_own_progress(step):
    anchor, mom, avg = _tensors(500, 1), _tensors(500, 2) * 0.1, _tensors(500, 3) * 0.01
    origin = anchor - _tensors(500, 4) * 0.01
    weights = origin - _tensors(500, 5) * 0.01  # two more inner steps while the exchange travelled
    before = [t.clone() for t in (anchor, mom, avg, weights, origin)]
    a, m, w = delayed_outer_update(OVER, step, anchor, mom, avg, weights, origin)
    assert all(torch.equal(x, y) for x, y in zip(before, (anchor, mom, avg, weights, origin)))  # pure
    a0, m0 = outer_step(OVER, step, anchor, mom, avg)
    assert torch.equal(a, a0) and torch.equal(m, m0)
    assert torch.equal(w, a + (weights - origin))
    if step == 3:  # the warm start averages: the anchor moves by the mean, the momentum stays
        assert torch.equal(a, anchor - avg) and torch.equal(m, mom)
    else:
        m_want = mom * 0.8 + avg
        assert torch.allclose(m, m_want) and torch.allclose(a, anchor - 0.7 * (avg + 0.8 * m_want))
    # another replica: other weights and origin, the same shared inputs -> the same anchor and momentum
    a2, m2, w2 = delayed_outer_update(OVER, step, anchor, mom, avg, weights + 1.0, origin - 1.0)
    assert torch.equal(a2, a) and torch.equal(m2, m) and not torch.equal(w2, w)
    # no progress since the exchange began: the weights are the new anchor
    assert torch.equal(delayed_outer_update(OVER, step, anchor, mom, avg, origin, origin)[2], a)


class SoloComm:
    """A group of one: the all-gather returns this member's own payload."""
    me = "solo"

    def isend(self, peer, tag, tensor):  # pragma: no cover - a group of one sends nothing
        raise AssertionError("a group of one sends nothing")


def test_overlap_without_progress_equals_the_synchronisation_that_waits():
    """Started and finished with no inner step between them, the overlapped exchange gives the
    bits of the one that waits: the same payload, the same outer step."""
    out = []
    for config in (RAMP, OVER):
        gen = torch.Generator().manual_seed(5)
        params = {"w": torch.nn.Parameter(torch.randn(30, 40, generator=gen) * 0.1)}
        sc = StageCompression(config, params, 0)
        with torch.no_grad():
            params["w"].sub_(torch.randn(30, 40, generator=gen) * 0.01)
        for step in (3, 5, 9):  # two warm-start averages, then the first outer step
            with torch.no_grad():
                params["w"].sub_(torch.randn(30, 40, generator=gen) * 0.01)
            if config.dp_overlap_steps:
                sc.start_sync(SoloComm(), ["solo"], list(params.values()), step, f"0.{step}/dpc", 1.0)
                sc.finish_sync(SoloComm(), ["solo"], list(params.values()), step, f"0.{step}/dpc", "x", 1.0)
            else:
                sc.sync(SoloComm(), ["solo"], list(params.values()), 0, step, f"0.{step}/dpc", 1.0)
        out.append((params["w"].detach().clone(), {k: v.clone() for k, v in sc.buffers.items()}))
    (w0, b0), (w1, b1) = out
    assert torch.equal(w0, w1)
    assert all(torch.equal(b0[k], b1[k]) for k in ("ef", "anchor", "outer_m"))


def anchor_hashes(cl: LocalCluster, s: int) -> list[bytes]:
    return [cl.states[p].compress.buffers["anchor"].numpy().tobytes() for p in cl.plan.dp_group(s)]


def test_replicas_share_the_synchronised_model_after_each_overlapped_sync(corpus):
    """The anchor (the synchronised model) is the same bits on every replica from the step each
    exchange lands on; the weights are each replica's own (its progress since the exchange
    began), and the DP bytes are sent at the synchronisation steps, as without the overlap."""
    landed = set(OVER_APPLIES.values())
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 3), corpus, compression=OVER) as cl:
        for step in range(16):
            cl.step()
            for s in range(2):
                assert len(set(anchor_hashes(cl, s))) == 1, (step, s)
                if step in landed:
                    assert len(set(replica_hashes(cl, s))) == 3, (step, s)  # the anchor plus each one's own steps
                    for p in cl.plan.dp_group(s):
                        st_ = cl.states[p]
                        weights = st_.compress._flat([q.detach() for q in st_.params.values()])
                        assert not torch.equal(weights, st_.compress.buffers["anchor"])
            assert (cl.last_step_bytes["dp"] > 0) == (step in RAMP_SYNCS), step
        anchors = anchor_hashes(cl, 0)
    # the exchange changes what the replicas compute: not the run without the overlap
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 3), corpus, compression=RAMP) as cl:
        cl.run(16)
        assert anchor_hashes(cl, 0) != anchors


def test_checkpoint_mid_exchange_carries_the_origin(tmp_path, corpus):
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 2), corpus, compression=OVER) as cl:
        cl.run(5)  # the sync after step 3 lands after step 5: in flight
        st_ = cl.states["peer1.1"]
        origin = st_.compress.buffers["origin"].clone()
    back = load_checkpoint(save_checkpoint(tmp_path, st_))
    assert back.compress.config == OVER and back.step == 5 and OVER.in_flight(5) == 3
    assert torch.equal(back.compress.buffers["origin"], origin)


@pytest.fixture(scope="module")
def not_stopping(corpus):
    """16 steps of 4 stages x 2 pipelines, never stopped: the losses, and each stage's replica and
    anchor hashes at the end."""
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 2), corpus, compression=OVER) as cl:
        return cl.run(16), {s: (replica_hashes(cl, s), anchor_hashes(cl, s)) for s in range(2)}


@pytest.mark.parametrize("stop", [4, 6, 11])  # an exchange in flight at each
def test_resume_mid_exchange_equals_not_stopping(corpus, not_stopping, stop):
    assert OVER.in_flight(stop) is not None
    plan = Plan.grid(4, 2, 2)
    straight, want = not_stopping
    with LocalCluster(SPEC, CFG, plan, corpus, compression=OVER) as cl:
        losses = cl.run(stop)
        saved = {p: ({k: v.clone() for k, v in stage_tensors(s_).items()}, s_.step, s_.optim.step_count)
                 for p, s_ in cl.states.items()}
    states = {p: stage_from_tensors(SPEC, CFG, plan.layer_ranges[plan.position(p)[1]], t, step, ostep,
                                    compression=OVER) for p, (t, step, ostep) in saved.items()}
    with LocalCluster(SPEC, CFG, plan, corpus, compression=OVER, states=states) as cl:
        losses += cl.run(16 - stop)
        assert losses == straight
        assert {s: (replica_hashes(cl, s), anchor_hashes(cl, s)) for s in range(2)} == want


def test_stage_transfer_mid_exchange(corpus):
    """A third pipeline joins while the sync after step 3 is in flight (its stages fetched by the
    transfer encoding, origin included): the group sends its payloads again on the new plan and
    every replica, the new ones included, holds the same synchronised model from then on."""
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 2, prefix="a"), corpus, compression=OVER) as cl:
        cl.run(5)
        cl.reconfigure(Plan.grid(4, 2, 3, prefix="a"))
        assert cl.states["a2.1"].step == 5
        assert torch.equal(cl.states["a2.1"].compress.buffers["origin"], cl.states["a0.1"].compress.buffers["origin"])
        for step in range(5, 12):
            cl.step()
            for s in range(2):
                assert len(set(anchor_hashes(cl, s))) == 1, (step, s)


def test_in_flight_contributions_give_the_anchor_that_lands(corpus):
    """The group's decoded payloads of an exchange in flight, summed in group order, give the
    anchor every replica holds once it lands (how bench/compress.py judges the synchronised
    model at the synchronisation steps)."""
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 3), corpus, compression=OVER) as cl:
        cl.run(10)  # the sync after step 9 is sent; it lands after step 11
        members = [cl.states[p].compress for p in cl.plan.dp_group(1)]
        total = members[0].in_flight_contribution().clone()
        for m in members[1:]:
            total += m.in_flight_contribution()
        avg = total / torch.full((), len(members), dtype=total.dtype)
        want = outer_step(OVER, 9, members[0].buffers["anchor"], members[0].buffers["outer_m"], avg)[0]
        cl.run(2)
        assert all(torch.equal(m.buffers["anchor"], want) for m in members)
