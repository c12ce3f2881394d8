"""Per-link compression in the step (train/worker.py with `Plan.links`): each pipeline link
uses the run's pipeline codec or stays exact, as both its ends read it from the plan, and each
stage's DP group its DP method or the exact all-reduce; exact groups stay bit-identical."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from compress_cluster import CFG, SPEC, replica_hashes

from dtfm.train import LinkCodecs, LocalCluster, Plan, load_corpus, split_batch
from dtfm.train.compress import CompressionConfig, activation_payload_bytes, parse_compression

# int4 + Hadamard links, DiLoCo every 2 steps, chosen per link
PER_LINK = CompressionConfig(pp_method="int4", pp_hadamard=True, dp_method="diloco", dp_topk_fraction=0.05,
                             dp_value_bits=2, dp_chunk_elems=1024, inner_steps=2, per_link=True)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=256 << 10)


def with_links(plan: Plan, links: LinkCodecs) -> Plan:
    return dataclasses.replace(plan, links=links)


def test_auto_is_slow_link_chosen_per_link():
    auto = parse_compression("auto")
    assert auto.per_link and dataclasses.replace(auto, per_link=False) == parse_compression("slow-link")
    assert parse_compression(auto.to_spec()) == auto
    assert parse_compression("pp-int8,per_link=true").per_link


def test_every_link_exact_trains_bit_for_bit_as_the_exact_run(corpus):
    plan = Plan.grid(4, 2, 2)
    with LocalCluster(SPEC, CFG, plan, corpus) as cl:
        exact = cl.run(3)
        exact_params = {p: [t.detach().clone() for t in st.params.values()] for p, st in cl.states.items()}
    with LocalCluster(SPEC, CFG, with_links(plan, LinkCodecs.uniform(2, 2, False, False)), corpus,
                      compression=PER_LINK) as cl:
        assert cl.run(3) == exact
        assert cl.bytes_sent["dp"] > 0 and cl.last_step_bytes["pp_fwd"] == 4 * 12 * 16 * 32  # fp32, every sample
        for p, st in cl.states.items():
            for a, b in zip(st.params.values(), exact_params[p]):
                assert a.detach().equal(b), p


def test_a_compressed_link_is_coded_at_both_ends_and_an_exact_link_is_not(corpus):
    comp = dataclasses.replace(PER_LINK, dp_method="exact")  # the pipeline axis alone
    plan = with_links(Plan.grid(4, 3, 2), LinkCodecs(((True, False), (False, True)), (False, False, False)))
    micro = split_batch(12, 2, 2)
    with LocalCluster(SPEC, CFG, plan, corpus, compression=comp) as cl:
        for _ in range(2):
            assert math.isfinite(cl.step())
            for s in range(3):
                assert len(set(replica_hashes(cl, s))) == 1  # exact DP: replicas identical
        got = cl.last_step_bytes
    # pipeline 0 codes its first link, pipeline 1 its second: per direction, one link coded, one exact per pipeline
    coded = sum(activation_payload_bytes((len(r), 16, 32), comp) for d in range(2) for r in micro[d])
    exact = sum(4 * len(r) * 16 * 32 for d in range(2) for r in micro[d])
    assert got["pp_fwd"] == got["pp_bwd"] == coded + exact


def test_mixed_dp_groups_an_exact_group_stays_identical_every_step(corpus):
    plan = with_links(Plan.grid(4, 2, 3), LinkCodecs(((True, False, True),), (True, False)))
    with LocalCluster(SPEC, CFG, plan, corpus, compression=PER_LINK) as cl:
        for step in range(4):
            assert math.isfinite(cl.step())
            synced = step % PER_LINK.inner_steps == PER_LINK.inner_steps - 1
            assert len(set(replica_hashes(cl, 1))) == 1, step  # exact group: identical after every step
            assert (len(set(replica_hashes(cl, 0))) == 1) == synced, step  # DiLoCo group: after each sync
        # the exact group's anchor follows its weights, so it can turn DiLoCo at any step
        st = cl.states[plan.dp_group(1)[0]]
        assert st.compress.buffers["anchor"].equal(torch.cat([p.detach().reshape(-1) for p in st.params.values()]))


# ----------------------------------------------------------------------------- the coordinator's choice


def view(slow_gbps: float = 0.001, fast_gbps: float = 10.0, codec_ns=None):
    """Four peers a b c d, every link fast (1 ms, `fast_gbps`) but a <-> b (`slow_gbps`);
    codec_ns: each peer's gossiped coding speed (4 x 7, nan unknown), None: all unknown."""
    import numpy as np

    from dtfm.gossip import NetworkView
    peers = tuple(bytes([i]) * 32 for i in range(4))
    delay = np.full((4, 4), 1.0)
    np.fill_diagonal(delay, 0.0)
    bw = np.full((4, 4), fast_gbps)
    bw[0, 1] = bw[1, 0] = slow_gbps
    np.fill_diagonal(bw, np.inf)
    codec = {} if codec_ns is None else {"codec_ns": np.asarray(codec_ns, dtype=float)}
    return NetworkView(peers, delay, bw, np.full(4, 1.0), True, **codec)


def test_the_coordinator_leaves_exact_only_what_saves_more_than_the_error_and_keeps_compressed_groups():
    from dtfm.control.coordinator.schedule import Placement, choose_links
    from dtfm.train import PRESETS, TrainConfig as TC
    v = view()
    a, b, c, d = v.peers
    shape = Placement(((a, b), (c, d)), ((0, 2), (2, 4)), (), 1.0, 1.0)
    auto = parse_compression("auto")
    got = choose_links(v, shape, PRESETS["tiny"], TC(), auto)
    # a -> b saves seconds; c -> d exact would save nothing the prediction can tell apart, so it
    # compresses too; the DP groups on fast links stay exact: DiLoCo's lost steps cost more than it saves
    assert got.links == LinkCodecs(((True, True),), (False, False))
    assert got.links_note.startswith("links compressed: p0 s0->s1 int4+hadamard/64 (saves ")
    assert "p1 s0->s1 int4+hadamard/64 (exact would save 0.000 s/iter, within the error)" in got.links_note
    assert "DP groups compressed: none" in got.links_note
    assert got.predicted_iteration_s < 2.0 and "(exact 8." in got.links_note and got.pipelines == shape.pipelines
    # a group that synchronised with DiLoCo in the epoch before keeps it (its replicas differ)
    kept = choose_links(v, shape, PRESETS["tiny"], TC(), auto, keep_compressed=[(1, 2)])
    assert kept.links.dp == (True, False) and "s0 diloco H=16 (kept" in kept.links_note
    # the kept group's prediction counts its DiLoCo cycle (local steps skip the fast all-reduce,
    # every H-th synchronises): close to, and not the same as, the exact group's
    assert kept.predicted_iteration_s != got.predicted_iteration_s
    assert kept.predicted_iteration_s == pytest.approx(got.predicted_iteration_s, rel=0.05)


def test_the_daemons_planner_chooses_links_at_the_start_and_keeps_compressed_groups_on_reconfiguration():
    import hashlib as hl

    from dtfm.control import Allocation
    from dtfm.control.config import PlaneConfig
    from dtfm.control.coordinator.request import TrainRequest
    from dtfm.control.planner import SchedulerPlanner
    from dtfm.train import PRESETS, TrainConfig as TC
    from machine_trace import start_op
    v = view()
    # (a budget the search meets on a loaded machine too: it is counted in wall time)
    planner = SchedulerPlanner(dataclasses.replace(PlaneConfig.test(), schedule_time_s=2.0))
    req = TrainRequest(stages=2, dp=2, compression=parse_compression("auto"))
    first = planner.first_placement(v, req, PRESETS["tiny"], TC(), {})
    assert first.links is not None and first.links_note.startswith("links compressed: ")
    # the search knew the codecs: the slow a <-> b link is left out or carries int4 (exact: 8.4 s)
    assert first.predicted_iteration_s < 2.0
    cur = Allocation(epoch=1, term=1, issuer=v.peers[0], run_id=bytes(16), pipelines=first.pipelines,
                     layer_ranges=first.layer_ranges, preset="tiny", model=PRESETS["tiny"], train=TC(),
                     data_hash=hl.sha256(b"d").hexdigest(), data_name="d", start_step=0, end_step=10,
                     compression=req.compression, compress_links=LinkCodecs(first.links.pp, (True, False)),
                     operator_start=start_op(stages=2, dp=2).encode())  # (the operator fixed the stages)
    nxt = planner.reshape(v, cur, live=frozenset(v.peers), remaining_steps=10, regions={}, seed=1, force=True)
    assert nxt.placement.links is not None and nxt.placement.links.dp[0]  # stage 0's group stays DiLoCo


def test_a_uniformly_compressed_run_is_placed_and_predicted_with_its_codecs():
    """slow-link compresses every link and group: the search knows it, and the prediction (what
    `train start` prints, what the drift check compares the measured steps with) is the
    simulator's with the run's codecs on every link, not the exact run's."""
    import hashlib as hl

    from dtfm.control import Allocation
    from dtfm.control.config import PlaneConfig
    from dtfm.control.coordinator.request import TrainRequest
    from dtfm.control.coordinator.schedule import predict_uniform
    from dtfm.control.planner import SchedulerPlanner
    from dtfm.train import PRESETS, TrainConfig as TC
    from machine_trace import start_op
    v = view(fast_gbps=0.01)  # every link slow
    planner = SchedulerPlanner(dataclasses.replace(PlaneConfig.test(), schedule_time_s=1.0))
    exact = planner.first_placement(v, TrainRequest(stages=2, dp=2), PRESETS["tiny"], TC(), {})
    slow_link = parse_compression("slow-link")
    first = planner.first_placement(v, TrainRequest(stages=2, dp=2, compression=slow_link), PRESETS["tiny"], TC(), {})
    assert first.links is None  # (no per-link choice: every link and group compresses)
    assert first.predicted_iteration_s == pytest.approx(
        predict_uniform(v, first, PRESETS["tiny"], TC(), slow_link).predicted_iteration_s)
    # exact tensors take seconds on these links, coded ones far less
    assert first.predicted_iteration_s < 0.5 * exact.predicted_iteration_s
    cur = Allocation(epoch=1, term=1, issuer=v.peers[0], run_id=bytes(16), pipelines=first.pipelines,
                     layer_ranges=first.layer_ranges, preset="tiny", model=PRESETS["tiny"], train=TC(),
                     data_hash=hl.sha256(b"d").hexdigest(), data_name="d", start_step=0, end_step=10,
                     compression=slow_link, operator_start=start_op(stages=2, dp=2).encode())
    nxt = planner.reshape(v, cur, live=frozenset(v.peers), remaining_steps=10, regions={}, seed=1, force=True)
    assert nxt.placement.links is None
    assert nxt.placement.predicted_iteration_s == pytest.approx(
        predict_uniform(v, nxt.placement, PRESETS["tiny"], TC(), slow_link).predicted_iteration_s)


def test_one_pipelines_prediction_charges_its_pipeline_codec_only():
    """A `slow-link` run of one pipeline trains with its pipeline codec alone (its DP groups of
    one synchronise nothing: train/plan.py): its prediction is the `pp-int4` run's, with no
    DiLoCo coding charged; two pipelines' is not."""
    from dtfm.control.coordinator.schedule import Placement, predict_uniform
    from dtfm.sched import CodecSpeed
    from dtfm.train import PRESETS, TrainConfig as TC
    v = view(fast_gbps=0.01)
    a, b, c, d = v.peers
    one = Placement(((a, b),), ((0, 2), (2, 4)), (c, d), 1.0, 1.0)
    two = Placement(((a, b), (c, d)), ((0, 2), (2, 4)), (), 1.0, 1.0)
    slow, pp = parse_compression("slow-link"), parse_compression("pp-int4")
    speed = CodecSpeed(int4_encode_ns_per_elem=5.0, int4_decode_ns_per_elem=3.0, hadamard_ns_per_elem=10.0,
                       sparse_encode_ns_per_elem=500.0, sparse_decode_ns_per_elem=200.0)

    def predicted(p, c):
        return predict_uniform(v, p, PRESETS["tiny"], TC(), c, speed=speed).predicted_iteration_s

    assert predicted(one, slow) == predicted(one, pp)
    assert predicted(two, slow) != predicted(two, pp)  # (two pipelines: DiLoCo groups, costed)


def test_a_per_link_start_takes_the_faster_of_the_codec_aware_and_the_exact_search(monkeypatch):
    from dtfm.control import planner as plane
    from dtfm.control.config import PlaneConfig
    from dtfm.control.coordinator.request import TrainRequest
    from dtfm.control.coordinator.schedule import Placement, choose_links
    from dtfm.train import PRESETS, TrainConfig as TC
    v = view()
    a, b, c, d = v.peers
    auto = parse_compression("auto")
    good = Placement(((a, c), (b, d)), ((0, 2), (2, 4)), (), 1.0, 1.0)  # the slow a <-> b link carries DP only
    bad = Placement(((a, b), (c, d)), ((0, 2), (2, 4)), (), 1.0, 1.0)  # activations over the slow link
    assert choose_links(v, bad, PRESETS["tiny"], TC(), auto).predicted_iteration_s > \
        choose_links(v, good, PRESETS["tiny"], TC(), auto).predicted_iteration_s
    planner = plane.SchedulerPlanner(dataclasses.replace(PlaneConfig.test(), schedule_time_s=0.2))
    req = TrainRequest(stages=2, dp=2, compression=auto)
    for aware, exact in ((bad, good), (good, bad)):  # whichever search misjudges, the faster plan wins
        monkeypatch.setattr(plane, "choose_shape", lambda *args, compression=None, aware=aware, exact=exact, **kw:
                            aware if compression is not None else exact)
        first = planner.first_placement(v, req, PRESETS["tiny"], TC(), {})
        assert first.pipelines == good.pipelines and first.links is not None


@pytest.mark.parametrize("slow,known,compresses,fast_compresses", [
    (None, 4, True, True),  # every peer at the reference CPU's measured speed
    (0, 4, False, True),  # a, the slow link's sender, codes 100 times slower: coding costs more than it saves
    (1, 4, False, True),  # b, its receiver
    (2, 3, True, False),  # c codes slowly, on the fast link: exact there; d reported no speed (the reference figure)
])
def test_the_coordinator_costs_coding_at_each_peers_gossiped_speed(slow, known, compresses, fast_compresses):
    import numpy as np

    from dtfm.control.coordinator.schedule import Placement, choose_links, codec_speeds_of, compression_options_of
    from dtfm.sched import REFERENCE_CODEC_SPEED, CodecSpeed
    from dtfm.train import PRESETS, TrainConfig as TC
    ref = np.array(REFERENCE_CODEC_SPEED.to_vector())
    codec = np.tile(ref, (4, 1))
    if slow is not None:
        codec[slow] *= 100
    codec[known:] = np.nan
    v = view(slow_gbps=0.05, codec_ns=codec)
    a, b, c, d = v.peers
    shape = Placement(((a, b), (c, d)), ((0, 2), (2, 4)), (), 1.0, 1.0)
    auto = parse_compression("auto")
    got = choose_links(v, shape, PRESETS["tiny"], TC(), auto)
    assert got.links.pp == ((compresses, fast_compresses),)
    assert got.links_note.endswith(f"coding at measured speeds of {known}/4 peers"
                                   + ("" if known == 4 else " (reference CPU for the rest)"))
    speeds = codec_speeds_of(v)
    assert speeds == tuple(CodecSpeed.from_vector(row) if k < known else REFERENCE_CODEC_SPEED
                           for k, row in enumerate(codec))
    assert compression_options_of(auto, view=v).peer_speeds == speeds  # what the search and reshape cost with
    assert compression_options_of(auto).peer_speeds == ()
    # with no speed gossiped at all: the reference figure everywhere, as before
    plain = choose_links(view(slow_gbps=0.05), shape, PRESETS["tiny"], TC(), auto)
    assert plain.links.pp == ((True, True),) and plain.links_note.endswith("0/4 peers (reference CPU for the rest)")


def test_time_to_loss_divides_the_iteration_by_the_codecs_step_efficiency():
    from dtfm.control.coordinator.schedule import Placement, time_to_loss_s
    from dtfm.sched import STEP_EFFICIENCY
    from dtfm.train import LinkCodecs
    from dtfm.train.compress import get_compression
    slow_link = get_compression("slow-link")
    base = Placement(((b"a" * 32, b"b" * 32), (b"c" * 32, b"d" * 32)), ((0, 2), (2, 4)), (), 1.0, 1.0)
    assert time_to_loss_s(base, slow_link) == 1.0  # no per-link choice: its iteration
    pp_only = dataclasses.replace(base, links=LinkCodecs(((True, True),), (False, False)))
    both = dataclasses.replace(base, links=LinkCodecs(((True, False),), (True, False)))
    assert time_to_loss_s(pp_only, slow_link) == 1.0 / STEP_EFFICIENCY["int4"]
    assert time_to_loss_s(both, slow_link) == 1.0 / (STEP_EFFICIENCY["int4"] * STEP_EFFICIENCY["diloco"])
